"""Tool calling on the OpenAI chat API: the request's ``tools`` and ``tool_choice``
(`definitions`), the model families' tool-call formats (`formats`), the parser that turns a
choice's text into content and tool calls, whole or streamed (`call_stream`), the grammar that
enforces ``required`` and named choices (`grammar`), and what one request needs of them (`plan`).
"""
