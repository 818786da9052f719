"""Real models on both sides: mla_bridge against Hugging Face transformers' DeepSeek-V2/V3 attention."""
