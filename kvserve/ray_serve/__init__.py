"""Engine replicas as Ray Serve deployments, placed by a KV-aware `RequestRouter` (issue 14).

`kvserve serve --replicas N` (N >= 2) and `serve run kvserve.ray_serve.app:build_app` deploy the
same pieces: `EngineReplica` (one engine and its OpenAI app), `OpenAIIngress` (the HTTP routes,
calling the replicas through a DeploymentHandle) and `KVAwareRequestRouter` (the kvserve router's
index and cost, inside Ray Serve's routing). docs/architecture.md, "Replicas on Ray Serve".
"""
