"""The ledger: the state machine, claims, submits and the tables they keep.

Importing any part of it registers every table on ``models.Base``'s metadata, those of agents' calls
(scope_models.py), of the provider's webhook events (webhook_models.py), of subjects' emergency stops
(stop_models.py) and of key uses (key_uses.py) included, and the history view (history.py), so a new
ledger is created whole whichever module asked first.
"""

from outbox.ledger import history as history
from outbox.ledger import key_uses as key_uses
from outbox.ledger import scope_models as scope_models
from outbox.ledger import stop_models as stop_models
from outbox.ledger import webhook_models as webhook_models
