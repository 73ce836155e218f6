"""The service layer's use cases that need more than the ledger may import (outbox/service/ has the
rest): the breakers, and the actions file as the workers load it. The HTTP API's operator routes,
the console and the command line call these; each maps the errors to its own answer."""
