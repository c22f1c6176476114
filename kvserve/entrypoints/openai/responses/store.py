"""The responses a server keeps for `previous_response_id` and GET /v1/responses/{id}: in
memory, least recently used first out, at most `--max-stored-responses` of them. Each keeps its
whole conversation (not a link to the previous response), so evicting one never truncates
another's history: an evicted id is a 404, never a conversation with a hole in it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.responses.conversation import as_input_items
from kvserve.entrypoints.openai.responses.objects import Turn
from kvserve.entrypoints.openai.responses.protocol import InputItem


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    conversation: list[InputItem]  # its input and output items, after earlier turns'


class ResponseStore:
    """Used from the event loop only, so it needs no lock."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def keep(self, turn: Turn, body: dict[str, Any]) -> None:
        """Store a finished turn, unless its request said store: false."""
        if not turn.request.stores or self.capacity <= 0:
            return
        conversation = turn.conversation + as_input_items(body["output"])
        self._responses[turn.response_id] = StoredResponse(body, conversation)
        self._responses.move_to_end(turn.response_id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
