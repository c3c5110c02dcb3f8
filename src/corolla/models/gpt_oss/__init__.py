"""OpenAI gpt-oss decoder layers (attention sinks, alternating sliding/full attention, clamped-SwiGLU MoE)."""
