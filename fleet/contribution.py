"""How much each backbone of a bundle contributes to a trained fleet's prototypes (FedPCL
Fig. 3's question), answered by re-opening every agent of a finished run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fleet.spec import RunResult


def backbone_contribution(
    result: RunResult, bundle: Path
) -> tuple[list[str], list[str], np.ndarray]:
    """FedPCL Fig. 3's question, answered with the trained heads: for each domain and
    backbone k, the cosine similarity between a client's class prototypes computed from
    all backbones and those computed from backbone k alone (the other backbones' feature
    blocks replaced by their mean over the client's data, which keeps the head's input
    in distribution), averaged over classes and over the domain's clients."""
    import torch

    from edge_agent.agent import Agent
    from edge_agent.config import load as load_agent_config
    from edge_agent.head import local_prototypes
    from edge_agent.train import embed
    from export.runtime import BackboneRuntime

    runtime = BackboneRuntime(bundle)
    members = runtime.bundle.members
    names = [m.name for m in members]
    bounds = np.cumsum([0] + [m.output_dim for m in members])
    sims: dict[str, list[np.ndarray]] = {}
    for client in result.clients:
        cfg_path = result.spec.out / "clients" / client.name / "agent.toml"
        agent = Agent(load_agent_config(cfg_path), runtime=runtime)
        feats = np.asarray(agent.features, dtype=np.float32)
        labels = torch.from_numpy(agent.train_labels)
        n_cls = agent.num_classes
        full, counts = local_prototypes(
            torch.from_numpy(embed(agent.model, feats)[0]), labels, n_cls
        )
        present = (counts > 0).numpy()
        row = []
        for k in range(len(members)):
            only = np.broadcast_to(feats.mean(0), feats.shape).copy()
            only[:, bounds[k] : bounds[k + 1]] = feats[:, bounds[k] : bounds[k + 1]]
            single, _ = local_prototypes(
                torch.from_numpy(embed(agent.model, only)[0]), labels, n_cls
            )
            cos = torch.nn.functional.cosine_similarity(single, full, dim=1).numpy()
            row.append(float(cos[present].mean()))
        sims.setdefault(client.domain, []).append(np.array(row))
    domains = sorted(sims)
    return domains, names, np.stack([np.mean(sims[d], axis=0) for d in domains])
