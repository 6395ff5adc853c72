"""OpenAI's API on the gateway: the request bodies as types (protocol), the routes (/v1/models, completions, chat,
Responses — stored ones in stored), tool calls and DeepSeek's reasoning and tool formats read back from the text."""
