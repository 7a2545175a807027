"""--vision (Qwen3.5 dense): preprocessing, the tower and image prompts against transformers on a
tiny random vision checkpoint, and the exactness equalities with images over a real server."""
import base64
import io
import json

import httpx2 as httpx
import numpy as np
import pytest
import torch
from PIL import Image

from test_exactness import assert_equal_solo, at_once, complete, serving, tiny_engine
from tensorfold.api.images import ImageLimits
from tensorfold.backends import backend_ops, cpu_ops
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.models.vision_tower import build_vision_tower
from tensorfold.sampling.params import SamplingParams
from tensorfold.vision.image import Preprocess, content_hash, open_image, patches
from tensorfold.vision.placement import ImageInput, expand, rope_positions
from tools.tiny_checkpoint import TINY_PREPROCESSOR, make_tiny_vision_checkpoint


def png(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGBA").convert(mode).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny_vision_checkpoint(str(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def hf(tiny_vl):
    from transformers import Qwen3_5ForConditionalGeneration
    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vl, dtype=torch.float32).eval()


# ---- preprocessing and the tower -----------------------------------------------------------------

SIZES = [(64, 64, "RGB"), (20, 30, "RGB"), (300, 120, "RGBA"), (500, 700, "L"), (33, 97, "P"), (1000, 40, "RGB")]


@pytest.mark.parametrize("width,height,mode", SIZES)
def test_preprocessing_equals_transformers_pillow_processor(width, height, mode):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    config = {k: v for k, v in TINY_PREPROCESSOR.items() if k != "image_processor_type"}
    reference = Qwen2VLImageProcessorPil(**config)
    pre = Preprocess(min_pixels=config["size"]["shortest_edge"], max_pixels=config["size"]["longest_edge"])
    data = png(width, height, seed=width, mode=mode)
    ours, grid = patches(data, pre)
    ref = reference(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert np.array_equal(ours, ref["pixel_values"])  # bitwise
    if width * height < pre.min_pixels:  # enlarged to the minimum
        assert grid[1] * grid[2] * 16 * 16 >= pre.min_pixels


def test_tower_matches_transformers_and_each_image_alone(tiny_vl, hf):
    tensors = {n: p.detach() for n, p in hf.named_parameters()}
    ckpt = type("Ckpt", (), {"config": hf.config.to_dict(), "tensors": tensors, "path": tiny_vl})
    tower = build_vision_tower(ckpt, torch.float32, cpu_ops, "cpu")
    pre = Preprocess.from_checkpoint(tiny_vl, {})
    for seed, (w, h) in enumerate([(64, 64), (100, 40), (200, 150)]):
        px, grid = patches(png(w, h, seed), pre)
        ours = tower.encode(px, grid)
        with torch.no_grad():
            ref = hf.model.visual(torch.from_numpy(px), grid_thw=torch.tensor([grid])).pooler_output
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
        assert torch.equal(ours, tower.encode(px, grid))


def test_erf_in_pieces_is_the_whole_series_and_close_to_erf():
    from tensorfold.models.vision_tower import ERF_PIECE, _erf_series, erf64
    x = torch.cat([torch.randn(3 * ERF_PIECE + 5, generator=torch.Generator().manual_seed(0)) * 3,
                   torch.linspace(-6, 6, 4001), torch.tensor([0.0, -0.0, 4.0, -4.0, float("inf"), -float("inf")])]).float()
    assert torch.equal(erf64(x.view(-1, 7)).view(-1), _erf_series(x))  # pieces: the same bits
    torch.testing.assert_close(erf64(x).float(), torch.erf(x), atol=1.2e-7, rtol=0)


def test_native_tower_encodes_an_image_beside_others_with_its_bits_alone(tiny_vl, hf):
    """encode_many (the image cache's misses of a round, together): each image's bits are its own."""
    tensors = {n: p.detach() for n, p in hf.named_parameters()}
    ckpt = type("Ckpt", (), {"config": hf.config.to_dict(), "tensors": tensors, "path": tiny_vl})
    tower = build_vision_tower(ckpt, torch.float32, backend_ops("cpu"), "cpu")
    pre = Preprocess.from_checkpoint(tiny_vl, {})
    images = [patches(png(w, h, seed), pre) for seed, (w, h) in enumerate([(64, 64), (100, 40), (200, 150)])]
    alone = [tower.encode(px, grid) for px, grid in images]
    for order in ([0, 1, 2], [2, 0, 1]):
        for i, emb in zip(order, tower.encode_many([images[i] for i in order])):
            assert torch.equal(emb, alone[i])


def test_rope_positions_equal_transformers_rope_index(hf):
    grids = [(1, 4, 6), (1, 6, 4)]
    images = [ImageInput(str(i), g, 2, b"") for i, g in enumerate(grids)]
    pad = hf.config.image_token_id
    ids, spans = expand([1, 2, 3, pad, 4, 5, pad, 6, 7], pad, images)
    mm = torch.tensor([[1 if t == pad else 0 for t in ids]])
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]), mm, image_grid_thw=torch.tensor(grids))
    for start, count in [(0, len(ids)), (0, 5), (5, 7), (12, len(ids) - 12)]:
        assert [list(r) for r in rope_positions(spans, start, count)] == ref[:, 0, start:start + count].tolist()
    # a reply's rows continue from the prompt's last position + 1 (transformers' rope delta)
    assert rope_positions(spans, len(ids), 2)[0] == [len(ids) + int(delta) + k for k in range(2)]


# ---- image prompts against transformers ----------------------------------------------------------

def _prompt(engine, images: list[bytes]):
    vision, tok = engine.info.vision, engine.tokenizer
    inputs = []
    for data in images:
        w, h = open_image(data).size
        inputs.append(ImageInput(content_hash(data), vision.preprocess.grid(h, w), 2, data))
    ids = tok.encode("Look:", add_special_tokens=False)
    for k in range(len(images)):
        ids += [vision.start_id, vision.pad_id, vision.end_id] + tok.encode(f" picture {k}.", add_special_tokens=False)
    ids += tok.encode(" Describe them.", add_special_tokens=False)
    return expand(ids, vision.pad_id, inputs) + (inputs,)


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_tokens_and_logits_equal_transformers(tiny_vl, hf, num_images):
    engine = Engine(tiny_vl, EngineConfig(vision=True, drafting=False, kv_cache_gib=0.01, probe=False))
    images = [png(100, 60, 1), png(70, 90, 2)][:num_images]
    ids, spans, inputs = _prompt(engine, images)
    req_id = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), images=spans)
    req = engine.requests[req_id]
    while req.finish_reason is None:
        engine.step()
    pre = engine.info.vision.preprocess
    pixels = torch.from_numpy(np.concatenate([patches(d, pre)[0] for d in images]))
    grids = torch.tensor([i.grid for i in inputs])
    mm = torch.tensor([[1 if t == engine.info.vision.pad_id else 0 for t in ids]])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=mm,
                          max_new_tokens=10, do_sample=False)
        ref_logits = hf(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids,
                        mm_token_type_ids=mm).logits[0, -1]
    assert req.output_ids == out[0, len(ids):].tolist()
    # the prefill's last-row logits: the engine's model on a one-request plan
    from tensorfold.engine.step_plan import ScheduledRequest, StepPlan
    runner, block = engine.runner, engine.pool.block_size
    blocks = engine.pool.allocate(-(-len(ids) // block))
    plan = StepPlan([ScheduledRequest("x", ids, 0, blocks, [], images=spans)])
    batch = runner._batch(plan)
    runner._place_images(plan, batch)
    batch.logits_rows = torch.tensor([len(ids) - 1])
    logits = runner.model.forward(batch, runner.cache)[0]
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4)
    # without the images' rows and positions the logits move: the test can fail
    plain = runner._batch(plan)
    plain.logits_rows = torch.tensor([len(ids) - 1])
    assert (runner.model.forward(plain, runner.cache)[0] - ref_logits).abs().max() > 1e-3


# ---- over HTTP: exactness with images, the API's forms and limits ---------------------------------

def chat(image_urls: list[str], text: str = "What is in the picture?", **extra) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls] + [{"type": "text", "text": text}]
    return dict(messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0.8, seed=3, **extra)


@pytest.fixture(scope="module")
def solo_vl(tiny_vl):
    done = {}
    with serving(tiny_engine(tiny_vl, vision=True, max_num_seqs=1, drafting=False)) as s:
        def reference(body):
            key = json.dumps(body, sort_keys=True)
            if key not in done:
                done[key] = complete(s.client, dict(body, draft=False))
            return done[key]
        yield reference


A, B = data_url(png(120, 80, 5)), data_url(png(80, 120, 6))


def test_cached_and_concurrent_replies_with_images_equal_solo(tiny_vl, solo_vl):
    long_text = "Describe the colours, the shapes and the light in detail, please. " * 4
    bodies = [chat([A], long_text), chat([B], long_text), chat([A, B], "Compare them."), chat([], "No image.")]
    refs = [solo_vl(b) for b in bodies]
    assert refs[0].sha != refs[1].sha or refs[0].text != refs[1].text  # the image matters
    with serving(tiny_engine(tiny_vl, vision=True, max_num_seqs=4, max_tokens_per_step=64)) as s:
        first = complete(s.client, bodies[0])
        again = complete(s.client, bodies[0])
        assert again.cached > 0 and again.cached >= first.cached
        assert_equal_solo(first, refs[0])
        assert_equal_solo(again, refs[0])
        other = complete(s.client, bodies[1])  # same text, another image: no cached block past the image
        image_at = next(i for i, t in enumerate(s.engine.tokenizer.encode(
            s.service.prompts.render(_greq(s, bodies[1]), None), add_special_tokens=False))
            if t == s.engine.info.vision.pad_id)
        assert other.cached <= image_at
        assert_equal_solo(other, refs[1])
        s.pause()
        calls = at_once([lambda b=b: complete(s.client, b) for b in bodies])
        s.wait_queued(len(bodies))
        s.resume()
        for call, ref in zip(calls, refs):
            assert_equal_solo(call.result(), ref)
        runner = s.engine.runner
        assert runner.images.misses == 2 and runner.images.hits > 0  # A and B encoded once each


def _greq(s, body):
    from tensorfold.api.request import parse_chat_request
    return parse_chat_request(dict(body, model="tiny"), s.service.defaults)


def test_responses_input_image_equals_the_chat_form(tiny_vl, solo_vl):
    body = chat([A], "Say something.")
    ref = solo_vl(body)
    with serving(tiny_engine(tiny_vl, vision=True)) as s:
        r = s.client.responses.create(model="tiny", max_output_tokens=12, temperature=0.8, store=False,
                                      extra_body={"seed": 3},
                                      input=[{"role": "user", "content": [
                                          {"type": "input_image", "image_url": A},
                                          {"type": "input_text", "text": "Say something."}]}])
        assert r.model_extra["tensorfold"]["token_sha"] == ref.sha
        assert r.output_text == ref.text


def test_limits_and_refusals_are_400s_naming_the_part(tiny_vl):
    with serving(tiny_engine(tiny_vl, vision=True)) as s:
        s.service.prompts.image_limits = ImageLimits(max_bytes=4000, max_pixels=200 * 200, max_images=2)
        url = "http://%s:%d/v1/chat/completions" % s.server.address
        small = data_url(png(40, 40, 1))
        cases = [
            (chat([small] * 3), "messages[0].content[2]", "--max-images"),
            (chat([data_url(png(300, 300, 2))]), "messages[0].content[0].image_url.url", "bytes"),
            (chat([data_url(png(250, 10, 3, mode="L"))]), None, None),  # within limits: served
            (chat(["https://example.com/cat.png"]), "messages[0].content[0].image_url.url", "data: URL"),
            (chat(["data:image/png;base64,!!!"]), "messages[0].content[0].image_url.url", "base64"),
            (chat([data_url(b"not an image")]), "messages[0].content[0].image_url.url", "cannot be read"),
        ]
        big = Image.new("RGB", (300, 300), (10, 20, 30))
        buf = io.BytesIO()
        big.save(buf, "PNG")  # compresses far below 4000 bytes: the pixel limit refuses it
        cases.append((chat([data_url(buf.getvalue())]), "messages[0].content[0].image_url.url", "--max-image-pixels"))
        for body, param, words in cases:
            r = httpx.post(url, json=dict(body, model="tiny"), timeout=60)
            if param is None:
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 400, (param, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err


def test_without_vision_an_image_is_a_400_that_says_how(tiny_vl):
    with serving(tiny_engine(tiny_vl)) as s:
        assert s.engine.runner.model.vision is None and s.engine.info.vision is None
        url = "http://%s:%d/v1/chat/completions" % s.server.address
        r = httpx.post(url, json=dict(chat([A]), model="tiny"), timeout=60)
        assert r.status_code == 400 and "--vision" in r.json()["error"]["message"]
        text = complete(s.client, chat([], "Just text."))  # the text model still serves
        assert text.sha
