"""Chapter 18's KV-cache transfer, what its file does not teach: the prompt's compute on
both sides (prefill: the model's shapes and its layers run layer by layer), bf16 matrix
products on a GPU's tensor cores (bf16) and what the two sides report (report).
"""
