"""The routes RL frameworks call (docs/specs/rl.md): vLLM's and SGLang's token routes (ids in,
entries out), vLLM's render and tokenizer routes, new weights in place, LoRA adapters, and the
control plane (pause, resume, caches)."""
