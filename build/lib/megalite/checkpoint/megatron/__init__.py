"""Reading Megatron-LM checkpoints (legacy `torch` and `torch_dist` formats) into megalite's, without Megatron.

formats.py finds the iteration and its format; legacy.py and torch_dist.py read each format into one
`MegatronState` (state.py: whole tensors under Megatron's names, per global layer); args.py turns Megatron's
`args` into megalite's config, data_args.py its data section (the blend Megatron read, to read on from it);
names.py maps names and layouts; convert.py writes the megalite checkpoint.
Every pickle is read through safe_pickle.py.
"""
