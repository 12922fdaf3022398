"""What the attention and position features ask of a model's shapes (config_validation.py runs these with every
other check): heads and groups, sliding windows and sinks, RoPE scaling."""

from __future__ import annotations

from megalite.config import ModelConfig


def attention_errors(m: ModelConfig) -> list[str]:
    errors = []
    if m.multi_latent_attention:  # its own head widths, checked by config_mla.py
        return errors
    if m.head_dim is not None and m.head_dim < 1:
        errors.append(f"model.head_dim={m.head_dim} must be >= 1, or unset (hidden_size / num_attention_heads)")
    elif m.head_dim is None and m.hidden_size % m.num_attention_heads:
        errors.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                      f"model.num_attention_heads={m.num_attention_heads}; pick heads that divide the width, or "
                      "set model.head_dim")
    if m.num_attention_heads % m.kv_heads:
        errors.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                      f"model.num_query_groups={m.kv_heads}; use a divisor of the head count")
    if m.features.position_embedding == "rope" and m.head_size % 2:
        width = "model.head_dim" if m.head_dim else "hidden_size/heads"
        errors.append(f"RoPE (model.position_embedding=rope) needs an even head dim, got {width}={m.head_size}; "
                      "change the width, the head count or model.head_dim")
    return errors


def window_and_sink_errors(m: ModelConfig) -> list[str]:
    """A window is a positive number of positions over existing layers; windows and sinks run through kernels
    without dropout (model/windowed_attention.py); the GLU's clamp needs a gated MLP."""
    errors = []
    if m.sliding_window is not None and m.sliding_window < 1:
        errors.append(f"model.sliding_window={m.sliding_window} must be >= 1 (positions a query sees, itself "
                      "included), or unset for full causal attention")
    if outside := [i for i in m.sliding_window_layers or [] if not 0 <= i < m.num_layers]:
        errors.append(f"model.sliding_window_layers has {outside}, but layers are numbered 0..{m.num_layers - 1}")
    if m.sliding_window_layers is not None and m.sliding_window is None:
        errors.append("model.sliding_window_layers is set without model.sliding_window; set the window's size")
    if (m.sliding_window is not None or m.features.attention_sinks) and m.attention_dropout:
        errors.append(f"model.attention_dropout={m.attention_dropout} with a sliding window or attention sinks: "
                      "their attention kernels have no dropout; set model.attention_dropout=0")
    if m.features.glu_limit is not None and (m.features.glu_limit <= 0 or not m.features.gated_mlp):
        errors.append(f"model.glu_limit={m.features.glu_limit} clamps a gated MLP's gate and up projection: it must "
                      "be > 0, with model.gated_mlp=true")
    return errors


def rope_scaling_errors(m: ModelConfig) -> list[str]:
    """Llama 3's scaling divides by rope_scaling_factor and by high - low frequency factors, YaRN by beta_fast -
    beta_slow's ramp (model/rope.py)."""
    if m.rope_scaling == "none":
        return []
    if m.features.position_embedding != "rope":
        return [f"model.rope_scaling={m.rope_scaling} scales RoPE, but model.position_embedding="
                f"{m.features.position_embedding}; set model.position_embedding=rope or model.rope_scaling=none"]
    errors = []
    if m.rope_factor < 1:
        errors.append(f"model.rope_scaling_factor={m.rope_factor} must be >= 1 (8 for Llama-3.1, 32 for 3.2 and "
                      "gpt-oss)")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        errors.append(f"need 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got "
                      f"{m.rope_low_freq_factor} and {m.rope_high_freq_factor} (Llama 3: 1 and 4)")
    if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow <= m.rope_beta_fast:
        errors.append(f"need 0 < model.rope_beta_slow <= model.rope_beta_fast, got {m.rope_beta_slow} and "
                      f"{m.rope_beta_fast} (YaRN: 1 and 32; Kimi K2: 1 and 1)")
    if m.rope_original_positions < 1:
        errors.append(f"model.rope_original_max_positions={m.rope_original_positions} must be >= 1: the context "
                      "the model was first trained at (Llama 3: 8192, gpt-oss: 4096)")
    return errors
