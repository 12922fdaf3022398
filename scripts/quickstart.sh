#!/usr/bin/env bash
# Install megalite into .venv, fetch the real assets (GPT-2 tokenizer, Shakespeare), preprocess
# the corpus into a Megatron .bin/.idx dataset, and pretrain a small GPT on it with torchrun:
# every local GPU, or 2 data-parallel CPU processes (gloo) when there is none. Then convert the
# checkpoint to a Hugging Face model and continue a prompt greedily with both megalite's
# tools/generate.py and transformers' generate (the two continuations are the same).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
bash scripts/get_assets.sh
OUT=runs/quickstart
rm -rf "$OUT"
python tools/preprocess_data.py --input assets/shakespeare --output-prefix "$OUT/data/shakespeare" \
  --tokenizer-type GPT2BPETokenizer --vocab-file assets/gpt2/vocab.json --merge-file assets/gpt2/merges.txt \
  --append-eod --workers 2
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 2)')}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_SILENT=true
torchrun --standalone --nproc_per_node="$NPROC" pretrain_gpt.py --config examples/tiny_cpu.yaml \
  --data.paths="$OUT/data/shakespeare_text_document" \
  --checkpoint.save="$OUT/checkpoints" --checkpoint.load="$OUT/checkpoints" --checkpoint.save_interval=100 \
  --logging.metrics_file="$OUT/metrics.jsonl" \
  --logging.wandb_project=megalite-quickstart --logging.wandb_mode=offline --logging.wandb_dir="$OUT"
python tools/convert_checkpoint.py --to-hf --load "$OUT/checkpoints" --save "$OUT/hf"
PROMPT="ROMEO:"
echo
echo "== megalite: tools/generate.py, greedy =="
python tools/generate.py --load "$OUT/checkpoints" --prompt "$PROMPT" --max-new-tokens 40 --temperature 0
echo "== transformers: generate on the converted model, greedy =="
python - "$OUT/hf" "$PROMPT" <<'PY'
import sys

import transformers

path, prompt = sys.argv[1:]
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForCausalLM.from_pretrained(path)
tokens = tokenizer(prompt, return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(tokens, max_new_tokens=40, do_sample=False)[0]))
PY
echo
echo "quickstart done:"
echo "  dataset     $OUT/data/shakespeare_text_document.{bin,idx}"
echo "  metrics     $OUT/metrics.jsonl ($(wc -l < "$OUT/metrics.jsonl") records)"
echo "  checkpoint  $OUT/checkpoints/iter_$(printf %07d "$(cat "$OUT/checkpoints/latest")")"
echo "  HF model    $OUT/hf  (transformers.AutoModelForCausalLM.from_pretrained)"
echo "  W&B run     $(ls -d "$OUT"/wandb/offline-run-* | tail -1)  (upload with: wandb sync DIR)"
