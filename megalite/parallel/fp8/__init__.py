"""FP8 matmuls: quantisation (quantize.py) and the recipes that plug into parallel/gemm.py's recipe slot
(recipes.py)."""

from megalite.parallel.fp8.recipes import RECIPES, Float8

__all__ = ["RECIPES", "Float8"]
