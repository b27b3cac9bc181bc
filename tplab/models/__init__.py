"""tplab.models — a small GPT (gpt.py, the unsplit reference) and its tensor-parallel copy (parallel.py)."""

from tplab.models.gpt import GPT, GPTConfig, generate
from tplab.models.parallel import ParallelGPT, parallelize

__all__ = ["GPT", "GPTConfig", "ParallelGPT", "generate", "parallelize"]
