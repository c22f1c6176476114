"""Every rank's transfer reports, merged: the engine core hears of a request's load or send
once every rank has reported it (vLLM's KVOutputAggregator). Ranks report on their own time
(each after the steps it runs, only when it has something), so counts carry over between
calls. A load is failed when any rank's part failed; the first reason is kept."""

from __future__ import annotations

from kvserve.protocol.worker import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sending: dict[str, int] = {}  # request id -> ranks that reported it
        self._recving: dict[str, int] = {}
        self._errors: dict[str, str] = {}

    def aggregate(self, reports: list[KVConnectorOutput]) -> KVConnectorOutput | None:
        """The transfers these reports complete (with the earlier ones'), or None."""
        if self.world_size == 1:
            return merge_reports(reports)
        done = KVConnectorOutput()
        for report in reports:
            for request_id in report.finished_sending:
                if self._count(self._sending, request_id):
                    done.finished_sending.append(request_id)
            for request_id, error in report.load_errors.items():
                self._errors.setdefault(request_id, error)
            for request_id in report.finished_recving:
                if self._count(self._recving, request_id):
                    done.finished_recving.append(request_id)
                    if request_id in self._errors:
                        done.load_errors[request_id] = self._errors.pop(request_id)
        return None if done.is_empty() else done

    def _count(self, counts: dict[str, int], request_id: str) -> bool:
        """One more rank reported it; True (and forgotten) when every rank has."""
        count = counts.get(request_id, 0) + 1
        if count < self.world_size:
            counts[request_id] = count
            return False
        counts.pop(request_id, None)
        return True


def merge_reports(reports: list[KVConnectorOutput]) -> KVConnectorOutput | None:
    """Reports of one rank (or of a single-rank engine) as one; None when there are none."""
    if not reports:
        return None
    if len(reports) == 1:
        return reports[0]
    merged = KVConnectorOutput()
    for report in reports:
        merged.finished_sending.extend(report.finished_sending)
        merged.finished_recving.extend(report.finished_recving)
        merged.load_errors.update(report.load_errors)
    return merged
