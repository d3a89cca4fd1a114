"""An OpenAI-compatible HTTP server over one SpeculativeLlama (`dflash serve`), standard library only.

/v1/completions and /v1/chat/completions take the request fields SpeculativeLlama's create_completion
and create_chat_completion take (OpenAI's, plus llama.cpp's top_k, min_p, repeat_penalty, grammar)
and return their results; `"stream": true` sends the chunks as server-sent events ending with
`data: [DONE]`. llama-server's native /completion, /infill (fill in the middle, for code editors),
/tokenize and /detokenize take its request fields and answer in its shapes; /v1/responses (OpenAI's
Responses API) and /v1/messages (Anthropic's Messages API) are chats in other words (openai_responses,
anthropic_messages). /v1/models, /props and
/health answer at once. Each of its slots (`parallel`, default 1) runs one generation at a time; more requests
wait for a free slot (the C++ loop releases the GIL, so the server stays responsive); a client that
disconnects mid-stream ends its generation. Bad
requests get a 400 with OpenAI's error shape, the server keeps serving.
"""

from .requests import BadRequest, request_kwargs
from .serving import DFlashServer, make_server, running, serving

__all__ = ["BadRequest", "DFlashServer", "make_server", "request_kwargs", "running", "serving"]
