"""Block-diffusion language models (SGLang's dLLM): the output is produced one block of
`block_size` positions at a time, each block denoised from mask tokens over several DLLM_EXTEND
forwards. `config.py`: a model's mask token and block size; `algorithm.py`: the denoising
algorithms by name; `block.py`: one request's block; `runner.py`: DLLM_EXTEND batches through the
model runner.

This package's `__init__` imports nothing, so that the model files may import `config` without
importing the runner (which imports the model runner, which imports the models)."""
