"""Chapter 18's KV-cache transfer, what its file does not teach: the prompt's compute on
both sides (prefill: the model's shapes and its layers run layer by layer, their matrix
products in bf16 on a GPU's tensor cores: common/gpu/bf16.py) and what the two sides
report (report).
"""
