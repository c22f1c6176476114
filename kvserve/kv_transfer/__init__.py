"""KV connectors: moving KV between engines (and, later, tiers).

`base.py` is the interface (vLLM v1's split): a scheduler side in the engine core (which
requests load KV from elsewhere, which finished requests keep their blocks, what the workers
do each step) and a worker side in every Worker (moving bytes in and out of that rank's KV
tensors), with `factory.py` naming them for `--kv-transfer-config` and `aggregator.py`
merging every rank's reports. `connector.TcpConnector` is disaggregated prefill and decode: a
prefill engine (`--kv-role prefill`) computes a request's prompt, keeps its blocks under a
lease and answers with a handle (`KVTransferParams`); a decode engine given that handle pulls
the blocks (tcp.py, shm.py) before it schedules the request, so the transferred tokens simply
count as computed. docs/disaggregation.md has the design and what other engines learnt.
"""

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.protocol.kv_transfer_params import KVTransferParams

__all__ = ["KVTransferConfig", "KVTransferParams"]
