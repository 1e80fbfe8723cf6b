"""specdecode: speculative decoding that keeps the target's output exactly, only sooner."""
