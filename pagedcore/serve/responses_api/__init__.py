"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``) over the chat path.

- ``request.py``: the request's fields (each implemented or refused by name) and its conversion to a chat request.
- ``items.py``: input items to chat messages; a response's output to the conversation's next turn.
- ``output.py``: the ``response`` object and its output items.
- ``render.py``: the whole response, or its server-sent events.
- ``store.py``: responses kept for ``previous_response_id`` (in memory, per tenant, bounded).

The endpoint itself is :mod:`pagedcore.serve.routes.responses`.
"""
