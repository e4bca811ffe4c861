"""Errors the engine raises for bad input. All are ValueError subclasses, so callers that only
know ValueError still catch them, and the server maps them to HTTP 400."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given (bad parameter, empty or too long prompt)."""


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
