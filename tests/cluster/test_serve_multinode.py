"""A TP 2 group spread over two nodes of a `ray.cluster_utils.Cluster`: rank 0 (the Serve
replica) on one, rank 1 (a Ray actor) on the other, all-reducing over gloo; greedy outputs through
the HTTP API equal transformers', and a stream survives the loss of rank 1's node."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.ports import free_port  # noqa: E402
from test_serve_e2e import MAX_NEW, PROMPTS, serve_app  # noqa: E402
from ray_clusters import loopback_cluster  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]


def test_a_group_spanning_two_nodes_equals_transformers_and_survives_losing_one(tiny_llama):
    """Three one-CPU nodes beside a head that runs no rank: the group holds two of them, and its
    greedy outputs through the HTTP API equal transformers'. Then the node of its rank 1 goes
    away mid-stream, and the stream continues on the group Serve starts on the two that remain,
    equal to the uninterrupted output. (One cluster for both: each costs half a minute.)"""
    from transformers import AutoTokenizer

    expected = hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    prompt, max_tokens = [5, 6, 7, 8], 80
    greedy = dict(temperature=0.0, extra_body={"ignore_eos": True})
    with loopback_cluster([dict(num_cpus=0)] + [dict(num_cpus=1)] * 3) as cluster:
        port = free_port()
        # The HTTP proxy on the head only: removing a node must not cut the client's
        # connection (the request's migration is what is tested, not the proxy's).
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        # One ingress replica: the group's migration is tested, not an ingress's loss.
        client = serve_app(tiny_llama, port, placement_strategy="STRICT_SPREAD",
                           ingress_replicas="1")
        handle = serve.get_deployment_handle("TPGroup", app_name="tpserve")
        ranks = handle.rank_info.remote().result()
        assert len({rank["node"] for rank in ranks}) == 2
        for text_prompt, want in zip(PROMPTS, expected):
            out = client.completions.create(model="tiny", prompt=text_prompt,
                                            max_tokens=MAX_NEW, temperature=0.0)
            assert out.usage.completion_tokens == len(want)
            assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        reference = client.completions.create(model="tiny", prompt=prompt,
                                              max_tokens=max_tokens, **greedy)
        rank_1_node = ranks[1]["node"]
        if rank_1_node == ingress_node():
            pytest.skip("the ingress replica landed on the node of rank 1: removing it "
                        "would end the client's request at the ingress, not at the group")
        node = next(n for n in cluster.worker_nodes if n.node_id == rank_1_node)
        texts = []
        for received, chunk in enumerate(client.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **greedy)):
            texts.append(chunk.choices[0].text)
            if received == 1:
                cluster.remove_node(node)
        assert "".join(texts) == reference.choices[0].text
        nodes = {rank["node"] for rank in handle.rank_info.remote().result()}
        assert rank_1_node not in nodes and len(nodes) == 2


def ingress_node() -> str:
    from ray.util.state import list_actors

    (actor,) = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
                if a.class_name.endswith("OpenAIIngress")]
    return actor.node_id
