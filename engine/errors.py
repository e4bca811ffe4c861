"""Errors the engine raises for bad input. All are ValueError subclasses, so callers that only
know ValueError still catch them, and the server maps them to HTTP 400."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given (bad parameter, empty or too long prompt).
    param: the request field at fault, when one is (the server reports it as the error's param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter outside its valid range."""


class ModelLoadError(ValueError):
    """A model folder that is missing, malformed or of an unsupported architecture."""


class InvalidStructuredOutputError(InvalidSamplingParamsError):
    """A structured-output constraint (JSON schema, regex, choice list) that cannot be compiled."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing a request that it had accepted (a server error, not the
    caller's): the request ends, the engine and every other request go on."""


class EngineShutdownError(RequestFailedError):
    """The engine is stopping (the server's grace period after SIGTERM ran out) and ended the
    request before it finished."""


# How the engine's error text begins when a request's own grammar broke while it generated.
STRUCTURED_OUTPUT_FAILED = "structured output failed"


class StructuredOutputFailedError(RequestFailedError):
    """The request's structured-output constraint broke while it generated (llguidance hit a
    limit on a pathological schema or regex): the caller's constraint, not an engine fault."""


class ExecutorFailedError(RuntimeError):
    """The executor cannot compute any more (a tensor-parallel worker died): the engine is dead,
    and a server must stop rather than hang."""
