"""tplab.models — a small GPT (gpt.py, the unsplit reference), its tensor-parallel copy (parallel.py),
Hugging Face GPT-2 and Llama converted to it (hf.py), memory per rank (memory.py) and speed (speed.py)."""

from tplab.models.gpt import GPT, GPTConfig, generate
from tplab.models.hf import from_hf_gpt2, from_hf_llama
from tplab.models.parallel import ParallelGPT, parallelize

__all__ = ["GPT", "GPTConfig", "ParallelGPT", "from_hf_gpt2", "from_hf_llama", "generate", "parallelize"]
