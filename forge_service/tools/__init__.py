"""Tool calling: what a request's `tools` change between the proto and the engine.

setup.py   the request's tools, checked (ToolSetup); tool_choice and parallel_tool_calls
formats.py how models write calls (Hermes/Qwen, Llama 3.1 JSON, Forge's default), chosen from
           the chat template; the default tool prompt
prompt.py  messages, tools and past calls as the chat template's inputs
grammar.py the grammar that enforces calls (required, named function, lazy auto)
parser.py  generated text -> content and tool-call deltas, incrementally
output.py  per request: parsing, the finish reason, the after-the-fact schema check

Plain Python (no torch): the servicer imports this before the model loads.
"""
