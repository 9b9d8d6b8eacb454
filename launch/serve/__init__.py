"""The HTTP serving layer (serve.port=PORT): an OpenAI-compatible API on rank 0, on top of the Session.

    server.py      the process's side: the port, the API key, uvicorn, signals; serve()
    app.py         the routes, the API key check, the limits, the connection hardening
    engine.py      the one thread that ticks the Session: jobs queued, admitted into slots, their text relayed
    fields.py      the request fields each endpoint reads (one table), the sampling parameters, the Prompt
    prompts.py     each endpoint's body into a Prompt (chat, completions, responses)
    forms.py       the answer forms, side by side: completions, chat, responses (whole or streamed)
    tools.py       tool calls: the request's tools checked, the calls read back out of the answer
    structured.py  response_format (a grammar) and logprobs
    errors.py      ApiError, and FieldError for every request field that cannot be served
    chat.py        tandem-chat, the terminal client (standard library only)
    front.py       under torchrun --max_restarts: the process that holds serve.port across restarts (standard library)

It depends one way: errors <- tools, structured <- fields <- prompts; forms and engine on those; app on all of
them; server on app and engine. It builds on launch/ (config, build, telemetry); nothing else in launch/ imports
it: the entry (train_free_infer.py) decides to serve (tests/launch/test_imports.py).
"""
