"""Anthropic's Messages API on the gateway: a Messages request served as the OpenAI chat completion it asks for
(as vLLM's Anthropic frontend does), its answer and stream written back in Anthropic's shape."""
