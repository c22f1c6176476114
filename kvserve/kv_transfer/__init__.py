"""KV transfer between engines: disaggregated prefill and decode.

A prefill engine (`--kv-role prefill`) computes a request's prompt, then keeps its KV blocks
under a lease and answers with a handle (`KVTransferParams`: where to pull, which blocks); a
decode engine (`--kv-role decode`) given that handle pulls the blocks into its own before it
schedules the request, so the transferred tokens simply count as computed. The shape is vLLM
v1's KV connector: a scheduler side (`connector.KVConnectorScheduler`: which requests load,
which finished requests are held, leases) and a worker side (`connector.KVConnectorWorker`:
moving bytes between KV tensors), with transports in `tcp.py`. docs/disaggregation.md has the
design and what other engines learnt.
"""

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.protocol.kv_transfer_params import KVTransferParams

__all__ = ["KVTransferConfig", "KVTransferParams"]
