"""The GPU check's steps, ranked: what a GPU hour should measure first. tools/gpu_check.py runs them in this order
and skips, with a line, each one the rest of its time budget (--budget) cannot hold, so a short call measures what
matters most; `estimate` is what each took on one H200 on 2026-11-27 (tests and fusions: expected, until they have
run), and `python tools/gpu_check.py --dry-run` prints the list with them.

The order after that hour: the eager fixes it pointed at first (tests: the fused kernels compile and agree with
the eager forms; fusions: their gain against the eager forms in one process), then the goals with them (train,
memory), the profile of the fixed step, Hugging Face, and the peers again (torchtitan's peak memory was read after
its own metrics had reset it: tools/peers/torchtitan_driver.py). A first call of 480 s runs tests, fusions, train,
memory and the profile; a second the throughput and the peers.

A new feature that needs a GPU figure (FP8 recipes against bf16, a DeepSeek-V3-shaped MoE step with latent
attention and multi-token prediction, Muon against AdamW, windowed / sink attention at 8k) adds its step here: a
function (Context) -> CheckResult, its dry-run lines, and one Step at the rank its figure deserves. Windowed / sink
attention has its step (attention, never run yet: its estimate is expected), ranked after the goals it does not
block; so has FP8 (fp8, never run yet: bf16 and three recipes, each compiled), ranked after the memory step: its
figures are issue 38's, and `--only fp8` runs it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megalite.planning.plan import make_plan
from tools.gpu_check_attention import COMMAND as ATTENTION_COMMAND
from tools.gpu_check_attention import step_attention
from tools.gpu_check_fp8 import NEED as FP8_NEED
from tools.gpu_check_fp8 import fp8_dry_run, step_fp8
from tools.gpu_check_fusions import fusions_dry_run, step_fusions
from tools.gpu_check_peers import local_attention_runs, peer_dry_run, peer_runs, run_peers
from tools.gpu_check_profile import profile_dry_run, step_profile
from tools.gpu_check_report import CheckResult
from tools.gpu_check_steps import (
    NEEDS,
    SHAPES,
    Context,
    benchmark_runs,
    display,
    flops_by_family,
    predicted_gib,
    pytest_command,
    shape_lines,
    step_memory,
    step_tests,
    step_throughput,
    step_train,
    train_runs,
)


@dataclass(frozen=True)
class Step:
    name: str
    about: str
    run: Callable[[Context], CheckResult]
    dry_run: Callable[[Context], list[str]]
    estimate: float  # seconds on one H200
    need: float  # seconds it needs at least to produce a figure; with less of the budget left it is skipped


def _train_dry_run(ctx: Context) -> list[str]:
    return [line for run in train_runs(ctx.out, ctx.train_iters) for line in (
        f"$ {display(run.command)}", f"  valid; planner ({ctx.gpu}): {make_plan(run.cfg, 1, ctx.gpu).verdict()}")]


def _throughput_dry_run(ctx: Context) -> list[str]:
    runs = benchmark_runs(ctx.gpu)
    flops = flops_by_family(runs)
    return [*(f"$ {display(run.command)}" for run in runs),
            *(f"  {label}: the model of {config}, {flops[family] / 1e9:.2f} GFLOP/token"
              for family, (label, config) in SHAPES.items()), *(f"  {line}" for line in shape_lines(runs))]


def _memory_dry_run(ctx: Context) -> list[str]:
    return [f"peak allocated in {display([str(run.metrics)])} against the planner's "
            f"{predicted_gib(make_plan(run.cfg, 1, ctx.gpu)):.2f} GiB (within {ctx.memory_tolerance:.0%})"
            for run in train_runs(ctx.out, ctx.train_iters)]


RANKED = (
    Step("tests", "pytest -m cuda tests/test_cuda.py tests/test_cuda_kernels.py: what CPU CI cannot run (the fused "
         "kernels compile here)", step_tests, lambda ctx: [f"$ {display(pytest_command())}"], estimate=50,
         need=NEEDS["tests"]),
    Step("fusions", "the eager fixes against the eager forms they replace (train.fusions off, then on), GPT-2 1.3B "
         "and Llama-3.2-1B, one process each", step_fusions, fusions_dry_run, estimate=140, need=70),
    Step("train", "pretrain_gpt.py, the GPT-2 1.3B and Llama-3.2-1B examples, bf16 parameters: MFU and memory",
         step_train, _train_dry_run, estimate=65, need=NEEDS["train"]),
    Step("memory", "the train step's peak memory against the planner", step_memory, _memory_dry_run,
         estimate=0, need=0),
    Step("fp8", "tools/fp8_convergence.py: bf16 against each FP8 recipe on Llama-3.1-8B's layer cut to 6 layers, "
         "compiled, 30 steps each (tokens/s, MFU, loss gap), each recipe's kernels against the emulation first",
         step_fp8, fp8_dry_run, estimate=300, need=FP8_NEED),
    Step("attention", "tools/benchmark_attention.py: a sliding window with sinks at 8k and 32k tokens against causal "
         "flash and SDPA with the window as a mask", step_attention,
         lambda ctx: [f"$ {display(ATTENTION_COMMAND)}"], estimate=40, need=30),
    Step("profile", "where megalite's eager GPT-2 1.3B and Llama-3.2-1B steps lose their time (kernel families, "
         "launch gaps, host syncs)", step_profile, profile_dry_run, estimate=110, need=60),
    Step("throughput", "megalite against Hugging Face, eager and compiled", step_throughput, _throughput_dry_run,
         estimate=330, need=NEEDS["eager"]),
    Step("peers", "megalite beside Megatron-Core (SDPA attention) and torchtitan, GPT-2 1.3B and Llama-3.2-1B, "
         "each peer in megalite's precision regime", lambda ctx: run_peers(ctx, "peers", peer_runs(ctx.out),
                                                                            ctx.wheels),
         lambda ctx: peer_dry_run(peer_runs(ctx.out), ctx.wheels), estimate=290, need=50),
    Step("peers_local", "Megatron-Core with its own unfused attention at GPT-2 1.3B (its lower bound)",
         lambda ctx: run_peers(ctx, "peers_local", local_attention_runs(ctx.out), ctx.wheels),
         lambda ctx: peer_dry_run(local_attention_runs(ctx.out), ctx.wheels), estimate=50, need=50),
)
STEPS = tuple(step.name for step in RANKED)
BY_NAME = {step.name: step for step in RANKED}
