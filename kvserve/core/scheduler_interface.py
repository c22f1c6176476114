"""What the engine core asks of a scheduler. `Scheduler` (core/scheduler.py) is the one we
have; another policy (e.g. one that schedules speculative drafts differently) implements this
and the engine core does not change."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from kvserve.core.request import Request, RequestStatus
    from kvserve.core.scheduler import SchedulerOutput
    from kvserve.protocol.worker import ModelRunnerOutput


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, request: Request, wait_for_grammar: bool = False) -> None:
        """Queue a new request (one waiting for its grammar stays out of the queue until
        `grammar_ready`)."""

    def grammar_ready(self, request_id: str) -> None:
        """A request that waited for its grammar joins the queue."""
        raise NotImplementedError

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """This step's batch: who runs, how many tokens each, who was preempted."""

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply a step's results; the requests that finished."""

    @abstractmethod
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request wherever it is (stop, length, abort) and free its blocks."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Anything waiting, running or loading."""

    @abstractmethod
    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is a request the scheduler holds (not finished)."""

    @abstractmethod
    def request_ids(self) -> list[str]:
        """The ids of every request the scheduler holds."""

    @abstractmethod
    def mark_in_flight(self, output: SchedulerOutput) -> None:
        """A batch went to a pipeline: its requests are neither scheduled again nor preempted
        until `mark_landed`."""

    @abstractmethod
    def mark_landed(self, output: SchedulerOutput) -> None:
        """A batch's results are in."""

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        from kvserve.core.request import RequestStatus

        for request_id in request_ids:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
