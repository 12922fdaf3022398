"""Read the records of an offline W&B run, to check what reached it (the reader is megalite's own:
megalite/training/wandb_offline.py, which a resumed offline run reads its earlier parts with)."""

from megalite.training.wandb_offline import read_run  # noqa: F401  (re-exported for the tests)
