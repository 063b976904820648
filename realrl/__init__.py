"""realrl: asynchronous RL runtime for LLMs."""
