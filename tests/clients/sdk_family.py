"""Run by the clients venv (Python 3.13) against a running `rlcd serve`: typesafe-sdk (sync and async) and
langchain-typesafe, as a new user would call them. Prints one JSON object of what each call returned.

argv: BASE_URL API_KEY IMAGE_PNG
"""

import asyncio
import json
import sys

import httpx2
from langchain_typesafe import Choice as LChoice
from langchain_typesafe import Noul as LNoul
from langchain_typesafe import Score as LScore
from langchain_typesafe import TypeSafeClassifier
from typesafe_sdk import (AsyncTypeSafeClient, Choice, Image, Noul, Score, TypeSafeAuthenticationError, TypeSafeClient,
                          TypeSafeUnprocessableEntityError)
from typesafe_sdk._core.compression import COMPRESSORS

base, key, image_path = sys.argv[1:4]
STATE = "Order 1182: I was charged twice for the parcel that never arrived. Please refund me today."
QS = {
    "refund": Noul(instructions="Does the customer ask for money back?"),
    "team": Choice(instructions="Which team?", criteria={"billing": "payments", "shipping": "parcels", "sales": None}),
    "anger": Score(instructions="How angry?", criteria=["Calm", "Frustrated", "Very angry"]),
}
sent: list[dict] = []


def record(request: httpx2.Request) -> None:
    sent.append({"path": request.url.path, "content_type": request.headers.get("content-type", ""),
                 "content_encoding": request.headers.get("content-encoding")})


def answers(r) -> dict:
    return {k: a.model_dump() for k, a in r.answers.items()}


out: dict = {"zstd_available": "zstd" in COMPRESSORS}
http = httpx2.Client(event_hooks={"request": [record]})
with TypeSafeClient(api_key=key, base_url=base, http_client=http) as c:
    for name, q in QS.items():  # every type alone
        r = c.system_one(state=STATE, questions={name: q})
        out[f"one_{name}"] = {"type": r.answers[name].type, "model": r.model, "request_id": r.request_id}
    r = c.system_one(state=STATE, questions=QS)  # many at once
    out["many"] = {"answers": answers(r), "nouls": sorted(r.nouls), "choices": sorted(r.choices),
                   "scores": sorted(r.scores), "usage": r.usage.model_dump(), "request_id": r.request_id}
    big = STATE + " " + "The tracking page says delivered, the porch was empty. " * 40  # > 1 KiB: zstd
    r = c.system_one(state=big, questions=QS)
    out["zstd"] = {"answers": answers(r), "sent": sent[-1]}
    with TypeSafeClient(api_key=key, base_url=base, compression=False) as plain:
        out["uncompressed"] = {"answers": answers(plain.system_one(state=big, questions=QS))}
    out["models"] = [m.model_dump() for m in c.models.list().models]
    img = Image(open(image_path, "rb").read())
    r = c.system_one(state="A product photo.", questions={"red": Noul(instructions=["Is the photo red?", img])},
                     assets={"photo": img})
    out["image_assets"] = {"answer": answers(r)["red"], "sent": sent[-1], "images": r.raw_http_response.json()["usage"]["images"]}
    with c.attach_assets(img):
        r = c.system_one(state=f"A product photo: {img}", questions={"red": Noul(instructions="Is it red?")})
        out["image_attached"] = {"sent": sent[-1], "images": r.raw_http_response.json()["usage"]["images"]}
    import base64
    r = c.system_one(state="A product photo.", questions={"red": Noul(instructions=["Is the photo red?", "photo"])},
                     extra_body={"assets": {"photo": {"type": "image", "format": "png",
                                                      "data_base64": base64.b64encode(img.data).decode()}}})
    out["image_json"] = {"sent": sent[-1], "images": r.raw_http_response.json()["usage"]["images"],
                         "answer": answers(r)["red"]}
    r = c.system_one(state=STATE, questions=QS, extra_body={"x_gate": True, "x_trace": "ignored"})
    out["gated"] = {k: v["x_gate"] for k, v in r.raw_http_response.json()["answers"].items()}
    out["gated_row"] = r.raw_http_response.json()["x_gate"]
    try:
        c.system_one(state=STATE, questions={"anger": Score(instructions="x", criteria=["only"])},
                     extra_body={"x_gate": "yes"})
        out["bad_extension"] = None
    except TypeSafeUnprocessableEntityError as e:
        out["bad_extension"] = e.status
try:
    with TypeSafeClient(api_key="wrong-key", base_url=base) as bad:
        bad.system_one(state=STATE, questions=QS)
    out["wrong_key"] = None
except TypeSafeAuthenticationError as e:
    out["wrong_key"] = {"status": e.status, "message": str(e), "body": e.body}


async def run_async() -> dict:
    async with AsyncTypeSafeClient(api_key=key, base_url=base) as ac:
        rs = await asyncio.gather(*(ac.system_one(state=f"{STATE} #{i}", questions=QS) for i in range(3)))
        models = await ac.models.list()
        return {"answers": [sorted(r.answers) for r in rs], "ids": [r.request_id for r in rs],
                "models": [m.name for m in models.models]}

out["async"] = asyncio.run(run_async())

classifier = TypeSafeClassifier(api_key=key, base_url=base)
request = {"state": STATE, "questions": {"refund": LNoul(instructions="Refund asked?"),
                                         "team": LChoice(instructions="Team?", criteria={"billing": "x", "shipping": "y"}),
                                         "anger": LScore(instructions="Anger?", criteria=["Calm", "Angry"])}}
lr = classifier.invoke(request)
out["langchain"] = {"noul": lr.nouls["refund"].noul, "choice": lr.choices["team"].choice, "score": lr.scores["anger"].score}
la = asyncio.run(classifier.ainvoke(request))
out["langchain_async"] = {"choice": la.choices["team"].choice}
print(json.dumps(out))
