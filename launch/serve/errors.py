"""The HTTP layer's one error: OpenAI's error object with its status. A request field that cannot be served is a
FieldError (a 400 naming the field), whichever module read the field (fields, prompts, tools, structured); the app
answers every ApiError the same way (launch/serve/app.py), so no parser turns one error into another by hand."""
from __future__ import annotations


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class FieldError(ApiError):
    """A request field that cannot be served: a 400 whose `param` names it."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(400, message, param=param, code=code)
