#!/usr/bin/env bash
# Install megalite into .venv (what training needs, and matplotlib for the plot; the tests' extras
# are scripts/test.sh's), fetch the real assets (GPT-2 tokenizer, Shakespeare), preprocess
# the corpus into a Megatron .bin/.idx dataset, and pretrain a small GPT on it with torchrun:
# every local GPU, or 2 data-parallel CPU processes (gloo) when there is none. Then plot the
# training curves, convert the checkpoint to a Hugging Face model, sample a continuation of a
# prompt with tools/generate.py, and check that greedy decoding gives the same tokens in megalite
# and in transformers. Each run replaces the previous one's runs/quickstart/ and says so first.
set -euo pipefail
STARTED=$SECONDS
OUT=runs/quickstart
echo "megalite quickstart: about 10 minutes on a 2-core CPU doing nothing else (longer when it is shared), plus"
echo "about 5 the first time to install torch and megalite into .venv; everything it writes goes to $OUT/"
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" plot
bash scripts/get_assets.sh
if [ -e "$OUT" ]; then
  echo "removing the previous quickstart run in $OUT/ (its dataset, checkpoints, metrics and W&B run)"
  rm -rf "$OUT"
fi
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
python tools/plot_metrics.py "$OUT/metrics.jsonl" --output "$OUT/metrics.png" --title "megalite quickstart"
python tools/convert_checkpoint.py --to-hf --load "$OUT/checkpoints" --save "$OUT/hf"
PROMPT="ROMEO:"
echo
echo "== megalite: tools/generate.py, a seeded top-k sample =="
python tools/generate.py --load "$OUT/checkpoints" --prompt "$PROMPT" --max-new-tokens 60 \
  --temperature 0.8 --top-k 40 --seed 1
# Greedy decoding of a model this small soon repeats newlines, so equal greedy tokens prove little:
# the converted model is also checked on the logits of a line of verse.
echo "== megalite and transformers (the converted model) agree =="
python - "$OUT/checkpoints" "$OUT/hf" "$PROMPT" <<'PY'
import sys

import torch
import transformers

from megalite.inference.generate import Sampling, generate, load_model

checkpoint, hf_dir, prompt = sys.argv[1:]
model, _, tokenizer = load_model(checkpoint, torch.device("cpu"))
hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
greedy = Sampling(max_new_tokens=40, temperature=0, stop_tokens=(tokenizer.eod,))
ours = generate(model, tokenizer.encode(prompt), greedy)
inputs = hf_tokenizer(prompt, return_tensors="pt")
out = hf_model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=hf_tokenizer.eos_token_id)
theirs = out[0, inputs.input_ids.shape[1]:].tolist()
if ours != theirs:
    sys.exit(f"greedy continuations differ:\n  megalite     {tokenizer.decode(ours)!r}\n"
             f"  transformers {hf_tokenizer.decode(theirs)!r}")
print(f"greedy, the same {len(ours)} tokens in both: {prompt + tokenizer.decode(ours)!r}")
verse = torch.tensor([tokenizer.encode("But soft, what light through yonder window breaks?")])
with torch.no_grad():
    gap = (model(verse) - hf_model(verse).logits).abs().max().item()
print(f"logits on a line of verse ({verse.shape[1]} tokens): max |megalite - transformers| = {gap:.1e}")
PY
echo
elapsed=$((SECONDS - STARTED))
echo "quickstart done in $((elapsed / 60))m$(printf %02d $((elapsed % 60)))s:"
echo "  dataset     $OUT/data/shakespeare_text_document.{bin,idx}"
echo "  metrics     $OUT/metrics.jsonl ($(wc -l < "$OUT/metrics.jsonl") records), curves in $OUT/metrics.png"
echo "  checkpoint  $OUT/checkpoints/iter_$(printf %07d "$(cat "$OUT/checkpoints/latest")")"
echo "  HF model    $OUT/hf  (transformers.AutoModelForCausalLM.from_pretrained)"
echo "  W&B run     $(ls -d "$OUT"/wandb/offline-run-* | tail -1)  (upload with: wandb sync DIR)"
