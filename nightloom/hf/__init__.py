"""Hugging Face interop: config.json -> ModelShape (both RoPE forms), state-dict names, weights in, export out.

`config` and `names` are pure Python; `load` and `export` import torch and safetensors when called."""
