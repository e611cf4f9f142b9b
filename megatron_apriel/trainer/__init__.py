"""GSPO trainer: pure loss maths, batch packing, the Megatron step and the run loop."""
