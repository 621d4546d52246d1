"""The logprobs page at `/` and Swagger UI at `/docs` in a real headless Chromium (Selenium,
Debian's chromium and chromium-driver) against the real server: nothing requested from anywhere
but the server, no console error, one element per token carrying the logprob the API returns for
the same request, the top-K card on hover, the scoring totals as the API's numbers, the API key
asked once. Screenshots go to tests/artifacts/. Skipped where no Chromium is installed."""

from __future__ import annotations

import codecs
import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from omlx_logprobs.config import Access
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.browser import (
    chromium,
    console_errors,
    offsite,
    requested_urls,
    screenshot,
    wait_for,
)
from tests.helpers.server import MODEL_NAME, assert_openai_error, thread_server

KEY = "page-test-key"
TOL = 1e-4  # the page's request and the API's run in different batches


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def keyed(scripted: LoadedModel) -> Iterator[str]:
    """The scripted reasoning model behind an API key (in this process: it starts in a second)."""
    with thread_server(scripted, access=Access(api_key=KEY), reasoning=True) as (base, _):
        yield base


def by_id(driver: Any, name: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def open_page(driver: Any, base: str, fragment: str = "") -> None:
    driver.get(base + "/" + fragment)
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready === 'true'"))


def fill(driver: Any, values: dict[str, Any]) -> None:
    """Set form fields as a person would leave them (value, then an input event)."""
    for name, value in values.items():
        driver.execute_script(
            "const el = document.getElementById(arguments[0]);"
            "if (el.type === 'checkbox') el.checked = arguments[1]; else el.value = arguments[1];"
            "el.dispatchEvent(new Event('input', {bubbles: true}));",
            name,
            value,
        )


def run_and_wait(driver: Any, button: str, output: str) -> None:
    by_id(driver, button).click()
    wait_for(
        lambda: by_id(driver, output).get_attribute("data-state") == "done",
        what=f"#{output} to finish",
    )


def page_tokens(driver: Any, selector: str) -> list[dict[str, Any]]:
    """Each token element: its token string, its text and the logprob it carries."""
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(el => ({"
            "token: el.entry.token, text: el.textContent, logprob: el.dataset.logprob,"
            "section: el.closest('.section').dataset.section}));",
            selector,
        )
    )


def texts(entries: list[dict[str, Any]]) -> list[str]:
    """What the page writes for each token of a section: the characters its bytes complete
    (a character split over tokens appears in the one that ends it), a special token's string."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [
        e["token"] if e["bytes"] is None else decoder.decode(bytes(e["bytes"])) for e in entries
    ]


def shown(token: str, raw: list[int] | None) -> str:
    """A token in the card: its bytes when they are whole UTF-8, else its string."""
    if raw is not None:
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            pass
    return token


def visible(text: str) -> str:
    return text.replace(" ", "·").replace("\n", "↵").replace("\t", "→").replace("\r", "␍")


def assert_clean(driver: Any, base: str) -> None:
    assert console_errors(driver) == []
    urls = requested_urls(driver)
    assert urls and offsite(urls, base) == [], offsite(urls, base)


def hover(driver: Any, element: Any) -> Any:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element(element).perform()
    tip = by_id(driver, "tip")
    wait_for(tip.is_displayed, 10, "the token card")
    return tip


def streamed_chat(client: openai.OpenAI, **body: Any) -> list[dict[str, Any]]:
    """The content entries of a streamed chat request, as JSON."""
    entries: list[dict[str, Any]] = []
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                entries += [e.model_dump() for e in c.logprobs.content]
    return entries


def test_page_assets_open_api_closed(keyed: str) -> None:
    """Without the key: the page, its assets and Swagger UI load; the API and its document do
    not. Files come from memory: a name that is not one of them is a 404, whatever it holds."""
    for path in ("/", "/static/page.js", "/static/page.css", "/static/favicon.svg", "/docs",
                 "/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"):  # fmt: skip
        r = httpx.get(keyed + path)
        assert r.status_code == 200 and r.headers["cache-control"] == "no-cache", path
    js = httpx.get(keyed + "/static/page.js").headers["content-type"]
    assert js.startswith("text/javascript")
    assert httpx.get(keyed + "/page/config").json() == {"api_key_required": True}
    assert "Apache License" in httpx.get(keyed + "/docs/LICENSE").text
    for path in ("/v1/models", "/openapi.json", "/tokenizer_info"):
        assert httpx.get(keyed + path).status_code == 401, path
    r = httpx.post(keyed + "/v1/completions", json={"model": "scripted-thinker", "prompt": "x"})
    assert r.status_code == 401
    # %2e: httpx itself would resolve a literal ".."
    for path in ("/static/%2e%2e/v1/models", "/static/nothing.js", "/docs/assets/index.html",
                 "/docs/assets/%2e%2e%2fpage.py", "/static/%2e%2e%2fpage.py"):  # fmt: skip
        assert_openai_error(httpx.get(keyed + path), 404, None)
    spec = httpx.get(keyed + "/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()
    assert spec["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    # nothing on the pages points off the server (the browser test checks what is requested)
    for path in ("/", "/docs"):
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", httpx.get(keyed + path).text), path


def test_page_and_docs_load_offline(browser: Any, server: str) -> None:
    requested_urls(browser), console_errors(browser)  # drain what came before
    open_page(browser, server)
    assert by_id(browser, "model").get_attribute("value") == MODEL_NAME
    assert not by_id(browser, "key-dialog").get_attribute("open")
    assert_clean(browser, server)

    browser.get(server + "/docs")
    wait_for(lambda: css(browser, ".swagger-ui .opblock"), 30, "Swagger UI's operations")
    paths = {e.text for e in css(browser, ".opblock-summary-path")}
    assert {"/v1/chat/completions", "/v1/completions"} <= paths
    assert_clean(browser, server)
    screenshot(browser, "docs")


def test_streamed_chat_renders_each_token_with_its_logprob(
    browser: Any, server: str, client: openai.OpenAI
) -> None:
    question = "Name three colours of autumn leaves."
    open_page(browser, server)
    fill(browser, {"user": question, "temperature": "0", "seed": "1234", "max_tokens": "8",
                   "top_logprobs": "5", "stream": True})  # fmt: skip
    run_and_wait(browser, "run", "gen-output")
    assert by_id(browser, "gen-error").get_attribute("hidden")
    got = page_tokens(browser, "#gen-output .tok")
    want = streamed_chat(
        client,
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        seed=1234,
        logprobs=True,
        top_logprobs=5,
    )
    assert len(got) == len(want) == 8
    for g, w, text in zip(got, want, texts(want)):
        assert g["section"] == "content"
        assert g["token"] == w["token"] and g["text"] == text
        assert abs(float(g["logprob"]) - w["logprob"]) < TOL

    # what Export JSON writes: the stream assembled into one response
    exported = browser.execute_script("return state.generation.response")
    assert exported["object"] == "chat.completion"
    entries = exported["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [w["token"] for w in want]
    assert [e["logprob"] for e in entries] == [float(g["logprob"]) for g in got]
    assert exported["choices"][0]["message"]["content"] == "".join(texts(want))

    # the card of the least likely token: its top 5, best first, the chosen one marked
    i = min(range(len(want)), key=lambda j: want[j]["logprob"])
    tip = hover(browser, css(browser, "#gen-output .tok")[i])
    rows = css(browser, "#tip .top li")
    top = want[i]["top_logprobs"]
    assert [r.find_element("css selector", ".chip").text for r in rows] == [
        visible(shown(t["token"], t["bytes"])) for t in top
    ]
    assert [r.find_element("css selector", ".rank").text for r in rows] == ["1", "2", "3", "4", "5"]
    bars = [float(r.find_element("css selector", ".fill").value_of_css_property("width")[:-2])
            for r in rows]  # fmt: skip
    assert bars == sorted(bars, reverse=True) and bars[0] > 0
    mine = [j for j, r in enumerate(rows) if "mine" in r.get_attribute("class")]
    own = [j for j, t in enumerate(top) if t["token"] == want[i]["token"]]
    assert mine == own[:1]
    assert f"{want[i]['logprob']:.4f}" in tip.text
    assert " ".join(f"{b:02x}" for b in want[i]["bytes"]) in tip.text
    screenshot(browser, "page-generate")
    assert_clean(browser, server)


def test_raw_completion_not_streamed(browser: Any, server: str, client: openai.OpenAI) -> None:
    prompt = "The three primary colours are"
    open_page(browser, server)
    browser.execute_script("document.querySelector('input[value=completion]').click()")
    fill(browser, {"prompt": prompt, "temperature": "0", "max_tokens": "8", "top_logprobs": "3",
                   "stream": False})  # fmt: skip
    run_and_wait(browser, "run", "gen-output")
    got = page_tokens(browser, "#gen-output .tok")
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert [g["token"] for g in got] == lp.tokens
    assert all(g["section"] == "text" for g in got)
    for g, w in zip(got, lp.token_logprobs):
        assert abs(float(g["logprob"]) - w) < TOL
    assert by_id(browser, "gen-export").is_enabled()

    # the request as code: both snippets, run, give the same tokens and logprobs
    for kind in ("python", "curl"):
        css(browser, f"#view-generate [data-code={kind}]")[0].click()
        code = by_id(browser, "code-text").text
        by_id(browser, "code-close").click()
        cmd = [sys.executable, "-c", code] if kind == "python" else ["bash", "-c", code]
        if kind == "curl" and shutil.which("curl") is None:
            continue
        ran = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        snippet = json.loads(ran.stdout)["choices"][0]["logprobs"]
        assert snippet["tokens"] == lp.tokens
        assert snippet["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=TOL)


def test_scoring_totals_match_the_api(browser: Any, server: str, client: openai.OpenAI) -> None:
    text = "The Eiffel Tower is in Paris, the capital of France. The Eiffel Tower is in Rome."
    open_page(browser, server, "#score")
    fill(browser, {"score-text": text, "score-k": "5"})
    run_and_wait(browser, "score-run", "score-output")
    r = client.completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=0, echo=True, logprobs=5,
        extra_body={"prompt_logprobs": 5, "return_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    lps = c.logprobs.token_logprobs
    assert lps[0] is None
    total = sum(lps[1:])
    got = page_tokens(browser, "#score-output .tok")
    assert [g["token"] for g in got] == c.logprobs.tokens
    assert got[0]["logprob"] is None
    for g, w in zip(got[1:], lps[1:]):
        assert abs(float(g["logprob"]) - w) < TOL

    values = {
        e.get_attribute("data-key"): float(e.get_attribute("data-value"))
        for e in css(browser, "#score-totals .fact")
    }
    assert values["tokens"] == len(lps) - 1
    assert values["sum"] == pytest.approx(total, abs=TOL * len(lps))
    assert values["mean"] == pytest.approx(total / (len(lps) - 1), abs=TOL)
    assert values["perplexity"] == pytest.approx(math.exp(-total / (len(lps) - 1)), rel=1e-4)
    assert values["bits"] == pytest.approx(-total / math.log(2), abs=TOL * len(lps))
    # the page's totals are its own tokens' numbers, summed in order
    page_sum = sum(float(g["logprob"]) for g in got[1:])
    assert values["sum"] == pytest.approx(page_sum, abs=1e-9)

    # the most surprising token's card: its rank as prompt_logprobs gives it
    i = min(range(1, len(lps)), key=lambda j: lps[j])
    tip = hover(browser, css(browser, "#score-output .tok")[i])
    own = c.model_extra["prompt_logprobs"][i][str(c.model_extra["prompt_token_ids"][i])]
    rank = [f for f in css(browser, "#tip .fact") if "RANK" in f.text.upper()][0]
    assert rank.find_element("css selector", ".value").text == str(own["rank"])
    assert f"id {c.model_extra['prompt_token_ids'][i]}" in tip.text
    screenshot(browser, "page-score")
    assert_clean(browser, server)


def test_api_key_asked_once_and_reasoning_apart(browser: Any, keyed: str) -> None:
    requested_urls(browser), console_errors(browser)
    browser.get(keyed + "/")
    dialog = by_id(browser, "key-dialog")
    wait_for(lambda: dialog.get_attribute("open") is not None, 10, "the key dialog")
    by_id(browser, "key-input").send_keys(KEY)
    by_id(browser, "key-save").click()
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready === 'true'"))
    assert by_id(browser, "model").get_attribute("value") == "scripted-thinker"

    fill(browser, {"user": "Case: bytes", "temperature": "0", "top_logprobs": "3",
                   "max_tokens": "64", "stream": True})  # fmt: skip
    run_and_wait(browser, "run", "gen-output")
    sections = [e.get_attribute("data-section") for e in css(browser, "#gen-output .section")]
    assert sections == ["reasoning_content", "content"]
    got = page_tokens(browser, "#gen-output .tok")

    client = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model="scripted-thinker", messages=[{"role": "user", "content": "Case: bytes"}],
        temperature=0, max_tokens=64, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    lp = r.choices[0].logprobs.model_dump()
    want = [("reasoning_content", e) for e in lp["reasoning_content"]]
    want += [("content", e) for e in lp["content"]]
    assert len(got) == len(want)
    shown_texts = texts(lp["reasoning_content"]) + texts(lp["content"])
    for g, (section, w), text in zip(got, want, shown_texts):
        assert g["section"] == section and g["token"] == w["token"] and g["text"] == text
        assert abs(float(g["logprob"]) - w["logprob"]) < TOL
    # characters split over tokens are whole in the text: the sections read as the message
    reasoning = "".join(g["text"] for g in got if g["section"] == "reasoning_content")
    content = "".join(g["text"] for g in got if g["section"] == "content")
    assert "😀日本" == r.choices[0].message.model_extra["reasoning_content"]
    assert "😀日本" in reasoning and r.choices[0].message.content in content

    css(browser, "#view-generate [data-code=curl]")[0].click()
    code = by_id(browser, "code-text").text
    assert "Authorization: Bearer $OMLX_LOGPROBS_API_KEY" in code and KEY not in code
    by_id(browser, "code-close").click()
    screenshot(browser, "page-reasoning")

    browser.refresh()  # the key is kept: no second question
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready === 'true'"))
    assert by_id(browser, "key-dialog").get_attribute("open") is None
    # Swagger UI sends the kept key for the document (which needs it)
    browser.get(keyed + "/docs")
    wait_for(lambda: css(browser, ".swagger-ui .opblock"), 30, "Swagger UI's operations")
    assert_clean(browser, keyed)


@pytest.fixture(scope="module")
def llava_served(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Any
) -> Iterator[tuple[str, str]]:
    """The tiny random LLaVA (tests/helpers/vision.py) in this process: (base URL, its name)."""
    from omlx_logprobs.models.loader import load_model
    from tests.helpers.vision import tiny_llava_dir

    model = load_model(str(tiny_llava_dir(tmp_path_factory.mktemp("llava"), tokenizer_dir)))
    with thread_server(model) as (base, _):
        yield base, model.name


def test_an_image_goes_with_the_message(
    browser: Any, llava_served: tuple[str, str], tmp_path: Any
) -> None:
    """An image chosen in the page goes with the user message as an image_url part: each
    token of the answer carries the logprob the API gives for the same image and text."""
    import base64

    from tests.helpers.vision import picture, png_bytes

    base, name = llava_served
    data = png_bytes(picture(3))
    (tmp_path / "picture.png").write_bytes(data)
    open_page(browser, base)
    by_id(browser, "image").send_keys(str(tmp_path / "picture.png"))
    wait_for(lambda: browser.execute_script("return state.image !== null"), what="the image")
    assert by_id(browser, "image-thumb").is_displayed()
    fill(browser, {"user": "What is this?", "temperature": "0", "max_tokens": "6",
                   "top_logprobs": "5", "stream": False})  # fmt: skip
    run_and_wait(browser, "run", "gen-output")
    assert by_id(browser, "gen-error").get_attribute("hidden")
    got = page_tokens(browser, "#gen-output .tok")
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=60)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    r = client.chat.completions.create(
        model=name,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    want = [e.model_dump() for e in r.choices[0].logprobs.content]
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        assert g["token"] == w["token"] and abs(float(g["logprob"]) - w["logprob"]) < TOL
    screenshot(browser, "page-image")
    by_id(browser, "image-clear").click()
    assert browser.execute_script("return state.image") is None
    assert_clean(browser, base)
