"""OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}`` (``code`` a string
or null), and the handlers answering with it: `APIError`, pydantic's request validation (400),
Starlette's HTTP errors (404 unknown path, 405). Source: vLLM's ``create_error_response``."""

import re
import reprlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_FIELD = re.compile(r"SamplingParams\.(\w+)|\b(max_tokens)=")
# FastAPI's detail when the body cannot be decoded at all (not UTF-8, say), said plainly
_UNREADABLE = {
    "There was an error parsing the body": "the request body could not be read: it must be "
    "UTF-8 encoded JSON"
}


class APIError(Exception):
    """An error answered with HTTP ``status``: `body`, its JSON, or `response`."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def invalid(cls, e: ValueError, param: str | None = None) -> "APIError":
        """A 400 for ``e`` naming the field its message names (``SamplingParams.<field>``, or
        ``max_tokens=``), else ``param``."""
        if (m := _FIELD.search(str(e))) is None:
            return cls(str(e), param=param)
        return cls(str(e).replace("SamplingParams.", ""), param=m.group(1) or m.group(2))

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        )
        return {"error": dict(message=str(self), type=kind, param=self.param, code=self.code)}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    @app.exception_handler(HTTPException)
    async def api_error(_, e: APIError | HTTPException) -> JSONResponse:
        if isinstance(e, APIError):
            return e.response()
        return APIError(_UNREADABLE.get(str(e.detail), str(e.detail)), e.status_code).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError) -> JSONResponse:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest: in a union's member
        if err["type"] == "json_invalid":  # loc is ("body", offset): not a parameter
            return APIError(f"the request body is not valid JSON: {err['msg']}").response()
        param = (
            ".".join(
                str(x)
                for x in err["loc"][1:]
                if not (isinstance(x, str) and (x in ("str", "int") or "[" in x or x[:1].isupper()))
            )
            or None
        )  # no union members
        got = "" if isinstance(v := err.get("input"), dict | list) else f" (got {reprlib.repr(v)})"
        return APIError(f"{param or 'body'}: {err['msg']}{got}", 400, param).response()
