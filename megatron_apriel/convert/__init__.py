"""Megatron <-> Hugging Face checkpoint conversion: a declarative table (mapping), pure tensor
transforms, and streaming checkpoint I/O."""
