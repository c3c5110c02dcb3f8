"""A hostile upstream writing values past float16's range before an honest float16 server (real processes,
decision 0186): a tiny llama served 0:2 by a liar (`hostile_server` mode `huge`: 1e6 in each position's first value,
announced fastest) and by an honest server, 2:4 by a float16 server (announced fastest; the test lets a CPU server
run float16) and a float32 one. Since 0170 the client routed around the honest float16 server (avoided 60 s, nobody
blamed) and sent the liar's outputs on through the float32 server: wrong tokens. Now the honest replica of 0:2
recomputes the step, disagrees, and the liar is avoided in the float16 server's place: the text is transformers'."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.float16_swarm import float16_chain, greedy_through
from tests.helpers.hostile_server import start_hostile_server
from tests.helpers.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=7)


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    def liar_of_the_first_span(swarm):
        return start_hostile_server(swarm, model_path, "huge", "--block_indices", "0:2", attract=True, wait=False)

    with float16_chain(model_path, tmp_path_factory, liar_of_the_first_span) as (swarm, narrow, liar):
        liar.wait_ready(150)
        swarm.liar, swarm.narrow = liar, narrow
        yield swarm


def test_an_upstream_writing_values_past_float16_is_avoided_in_the_float16_servers_place(swarm, model_path):
    expected = hf_greedy(model_path, PROMPT, NEW_TOKENS)
    output, banned, avoided = greedy_through(swarm, model_path, PROMPT, NEW_TOKENS)
    assert output.tolist() == expected.tolist()  # main: the liar's 1e6 went on through the float32 server
    assert swarm.narrow.peer_id not in avoided  # main: the honest float16 server, avoided for the liar's values
    assert swarm.liar.peer_id in avoided | banned
    assert not banned - {swarm.liar.peer_id}
