"""Known-posterior typed-decision cases: the answer distribution of every question is the truth.

Each case is one JSON state (a support ticket or an invoice, in English or German) with six
questions: a choice over a random subset of 2..12 topics/categories, a choice with described
options, two noul questions and two score questions (3..6 levels). Four sampling groups:
`synth/{en,de}/{support-triage,invoice-approval}`, assigned round-robin by case index.

The posterior of every question is a deterministic function of *visible* state fields, so it is
exactly P(answer | state): a model that reads the state can reach it, and calibration is measured
against truth rather than a teacher. Randomness lives only in drawing the state and, with
`votes=n`, in the target, which is then the mean of n one-hot draws from the posterior (a teacher
that averages n samples). Every field is always present and every free-text slot is always
filled, with neutral filler when it carries no signal, so neither length nor layout gives an
answer away.

Features (all simple and local):
  t      index of the category whose keyword is in the primary text field
         (support: `subject`, invoice: `description`); exactly one keyword of TOPIC_KEYWORDS /
         CATEGORY_KEYWORDS is there.
  s      index of the category whose keyword is in the secondary field (support: `message`,
         invoice: `note`), or none (probability 1/2; then a neutral filler sentence).
  u      level 0/1/2 of the phrase in the secondary field (support TONES: calm/annoyed/angry,
         invoice TERMS: standard terms/reminder/final notice).
  support:  tier = index of `customer_tier` in TIERS (basic, pro, enterprise); sla =
            `sla_breached`; n = `open_tickets` (0..4).
  invoice:  band = index of `amount_band` in BANDS (under 500, 500-5,000, over 5,000; `amount`
            lies in that band); dup = `duplicate_suspected`; new = `vendor_status` is "new"
            (index 1 of VENDOR_STATUS); po = `purchase_order`; n = `line_items` (1..5).
  [x] is 1 if x holds else 0. Draws: t, tier, band, u uniform; s present with probability 1/2;
  sla 0.3, dup 0.2, new 0.3, po 0.7; n uniform on its range; ids, names, templates uniform.

Posteriors (softmax over the question's candidates, in their listed order):
  choice with a category subset (support `topic`, invoice `category`; candidates: t plus K-1
  other categories drawn without replacement, K uniform in 2..12, in canonical order; s counts
  only when it is among them):
      logit_j = 3.5 [j = t] + 1.5 [j = s]
  support `queue` (standard, priority, account-manager, complaints):
      logits = (2, 4 sla, 4 [tier = 2], 4 [u = 2])
  invoice `approver` (team-lead, finance-manager, cfo):
      logit_j = 3 [j = band]
  noul (candidates false, true): logits = (0, z) with
      support `escalate`:  z = -2.5 + 3 sla + 2 [tier = 2] + 2 [u = 2]
      support `recontact`: z = -2 + n + 1.5 [u >= 1]
      invoice `hold`:      z = -3 + 4 dup + 2 new + 2 (1 - po)
      invoice `due_soon`:  z = -2.5 + 2.5 u
  score with L levels: logit_l = -2 (l - mu)^2 (a Gaussian of sd 0.5 around mu), l = 0..L-1,
  with integer mu clipped to 0..L-1:
      support `urgency` (L=4): mu = sla + [u >= 1] + [u = 2] + [tier = 2]
      support `effort`  (L=3): mu = [t in TECHNICAL (bug, performance, integration, data-export)]
                               + [s is not none]
      invoice `fraud_risk` (L=5): mu = 2 dup + new + (1 - po) + [band = 2]
      invoice `priority`   (L=6): mu = 2 u + [band = 2] + [n >= 4]

Generation: case i uses `numpy.random.default_rng([seed, i])` for its state and candidate subsets
and `default_rng([seed, i, 1])` for votes, so case i does not depend on `n_cases` or on `votes`.
Ids: case `synth-{seed}-{i:05d}`, record `{case_id}:{qid}`.
"""

from __future__ import annotations

import numpy as np

from rlcd.schema import Record

SOURCE = "synth"
LANGUAGES = ("en", "de")
WORKFLOWS = ("support-triage", "invoice-approval")
SCORE_SD = 0.5
TECHNICAL = (4, 5, 9, 10)  # bug, performance, integration, data-export

# --- support-triage vocabulary --------------------------------------------------------------

TOPICS = {
    "en": ("billing", "login", "shipping", "refund", "bug", "performance", "feature-request",
           "account-deletion", "security", "integration", "data-export", "cancellation"),
    "de": ("Abrechnung", "Anmeldung", "Versand", "Erstattung", "Fehler", "Leistung",
           "Funktionswunsch", "Kontolöschung", "Sicherheit", "Integration", "Datenexport",
           "Kündigung"),
}
TOPIC_KEYWORDS = {
    "en": (("double charge", "invoice amount"), ("password reset", "sign in"),
           ("parcel", "tracking number"), ("money back", "reimbursement"),
           ("error message", "crashes"), ("very slow", "timeout"), ("feature idea", "wishlist"),
           ("delete my account", "close my profile"), ("phishing", "hacked"),
           ("API key", "webhook"), ("CSV export", "download my data"),
           ("cancel my subscription", "end the contract")),
    "de": (("doppelte Abbuchung", "Rechnungsbetrag"), ("Passwort zurücksetzen", "einloggen"),
           ("Paket", "Sendungsnummer"), ("Geld zurück", "Rückzahlung"),
           ("Fehlermeldung", "stürzt ab"), ("sehr langsam", "Zeitüberschreitung"),
           ("Verbesserungsvorschlag", "Wunschliste"), ("Konto löschen", "Profil entfernen"),
           ("Phishing", "gehackt"), ("API-Schlüssel", "Webhook"),
           ("CSV-Export", "Daten herunterladen"), ("Abo kündigen", "Vertrag beenden")),
}
SUBJECTS = {
    "en": ("Question about {kw}", "Issue: {kw}", "Need help with {kw}"),
    "de": ("Frage zu {kw}", "Problem: {kw}", "Hilfe bei {kw}"),
}
OPENINGS = {
    "en": ("Hello team,", "Hi,", "Good morning,"),
    "de": ("Hallo Team,", "Hallo,", "Guten Morgen,"),
}
MENTION = {
    "en": ("I also have a question about {kw}.", "I have attached a few screenshots."),
    "de": ("Außerdem habe ich eine Frage zu {kw}.", "Ich habe ein paar Screenshots angehängt."),
}
TONES = {
    "en": (("Thanks in advance.", "No rush, thank you."),
           ("This is the second time I am asking.", "I am getting frustrated."),
           ("This is completely unacceptable!", "I am furious about this!")),
    "de": (("Vielen Dank im Voraus.", "Keine Eile, danke."),
           ("Ich frage bereits zum zweiten Mal.", "Das ist langsam ärgerlich."),
           ("Das ist völlig inakzeptabel!", "Ich bin wirklich wütend!")),
}
TIERS = {"en": ("basic", "pro", "enterprise"), "de": ("Basis", "Pro", "Enterprise")}
CHANNELS = {"en": ("email", "chat", "phone"), "de": ("E-Mail", "Chat", "Telefon")}
SUPPORT_NOTES = {
    "en": ("Created from the web form.", "Customer identity verified.", "Forwarded by the night shift."),
    "de": ("Über das Webformular erstellt.", "Identität des Kunden geprüft.", "Von der Nachtschicht weitergeleitet."),
}

# --- invoice-approval vocabulary ------------------------------------------------------------

CATEGORIES = {
    "en": ("software", "hardware", "travel", "catering", "office-supplies", "consulting",
           "marketing", "rent", "utilities", "legal", "training", "logistics"),
    "de": ("Software", "Hardware", "Reisen", "Bewirtung", "Büromaterial", "Beratung",
           "Marketing", "Miete", "Nebenkosten", "Recht", "Schulung", "Logistik"),
}
CATEGORY_KEYWORDS = {
    "en": (("license renewal", "SaaS subscription"), ("laptops", "monitors"),
           ("flight tickets", "hotel stay"), ("lunch buffet", "coffee service"),
           ("printer paper", "stationery"), ("advisory hours", "workshop facilitation"),
           ("ad campaign", "trade fair booth"), ("office lease", "parking spaces"),
           ("electricity", "water supply"), ("contract review", "trademark filing"),
           ("online course", "certification exam"), ("freight forwarding", "pallet storage")),
    "de": (("Lizenzverlängerung", "SaaS-Abonnement"), ("Laptops", "Monitore"),
           ("Flugtickets", "Hotelübernachtung"), ("Mittagsbuffet", "Kaffeeservice"),
           ("Druckerpapier", "Schreibwaren"), ("Beratungsstunden", "Workshop-Moderation"),
           ("Werbekampagne", "Messestand"), ("Büromiete", "Stellplätze"),
           ("Strom", "Wasserversorgung"), ("Vertragsprüfung", "Markenanmeldung"),
           ("Onlinekurs", "Zertifizierungsprüfung"), ("Speditionsleistung", "Palettenlager")),
}
DESCRIPTIONS = {
    "en": ("Invoice for {kw}", "Charges for {kw}", "Services: {kw}"),
    "de": ("Rechnung für {kw}", "Kosten für {kw}", "Leistung: {kw}"),
}
INVOICE_MENTION = {
    "en": ("Also includes {kw}.", "Delivery note attached."),
    "de": ("Enthält außerdem {kw}.", "Lieferschein liegt bei."),
}
TERMS = {
    "en": (("Standard payment terms apply.", "Payable within 30 days."),
           ("This is a friendly payment reminder.", "Reminder: payment is now due."),
           ("Final notice before collection.", "Last reminder before legal action.")),
    "de": (("Es gelten die üblichen Zahlungsbedingungen.", "Zahlbar innerhalb von 30 Tagen."),
           ("Dies ist eine freundliche Zahlungserinnerung.", "Erinnerung: Die Zahlung ist jetzt fällig."),
           ("Letzte Mahnung vor dem Inkasso.", "Letzte Mahnung vor rechtlichen Schritten.")),
}
BANDS = {"en": ("under 500", "500 to 5,000", "over 5,000"), "de": ("unter 500", "500 bis 5.000", "über 5.000")}
BAND_RANGES = ((20.0, 500.0), (500.0, 5000.0), (5000.0, 50000.0))
VENDOR_STATUS = {"en": ("known", "new"), "de": ("bekannt", "neu")}
VENDORS = ("Nordwind GmbH", "Acme Supplies", "Blue Harbor Ltd", "Kessler & Partner", "Pinecrest Inc", "Rheinwerk AG")
CURRENCIES = ("EUR", "USD")

# --- questions ------------------------------------------------------------------------------

TEXT = {
    "en": {
        "topic": "Which topic is this ticket mainly about?",
        "queue": ("Which queue should handle this ticket?", {
            "standard": "Regular support queue", "priority": "Fast lane for SLA breaches",
            "account-manager": "Personal handling for enterprise customers",
            "complaints": "Complaint desk for angry customers"}),
        "escalate": ("Should this ticket be escalated?", {
            "false": "Handle at first level", "true": "Escalate to a team lead"}),
        "recontact": "The customer will contact us again about this within a week.",
        "urgency": ("How urgent is this ticket?", ["low", "medium", "high", "critical"]),
        "effort": ("How much work will resolving it take?", ["quick answer", "some investigation", "deep investigation"]),
        "category": "Which expense category does this invoice belong to?",
        "approver": ("Who has to approve this invoice?", {
            "team-lead": "Approves amounts under 500", "finance-manager": "Approves amounts from 500 to 5,000",
            "cfo": "Approves amounts over 5,000"}),
        "hold": ("Should the payment be put on hold?", {
            "false": "Release for payment", "true": "Hold the payment for review"}),
        "due_soon": "This invoice must be paid within 7 days.",
        "fraud_risk": ("How likely is this invoice to be fraudulent?", ["none", "low", "moderate", "high", "severe"]),
        "priority": ("How soon should this invoice be processed?",
                     ["can wait", "low", "normal", "elevated", "high", "immediate"]),
    },
    "de": {
        "topic": "Um welches Thema geht es in diesem Ticket hauptsächlich?",
        "queue": ("Welche Warteschlange soll das Ticket bearbeiten?", {
            "Standard": "Reguläre Support-Warteschlange", "Priorität": "Schnellspur bei SLA-Verletzungen",
            "Kundenbetreuer": "Persönliche Betreuung für Enterprise-Kunden",
            "Beschwerdestelle": "Beschwerdestelle für verärgerte Kunden"}),
        "escalate": ("Soll dieses Ticket eskaliert werden?", {
            "false": "Im First-Level bearbeiten", "true": "An die Teamleitung eskalieren"}),
        "recontact": "Der Kunde meldet sich deswegen innerhalb einer Woche erneut.",
        "urgency": ("Wie dringend ist dieses Ticket?", ["niedrig", "mittel", "hoch", "kritisch"]),
        "effort": ("Wie viel Arbeit macht die Lösung?", ["kurze Antwort", "etwas Recherche", "tiefe Analyse"]),
        "category": "Zu welcher Kostenkategorie gehört diese Rechnung?",
        "approver": ("Wer muss diese Rechnung freigeben?", {
            "Teamleitung": "Gibt Beträge unter 500 frei", "Finanzleitung": "Gibt Beträge von 500 bis 5.000 frei",
            "Finanzvorstand": "Gibt Beträge über 5.000 frei"}),
        "hold": ("Soll die Zahlung angehalten werden?", {
            "false": "Zur Zahlung freigeben", "true": "Zahlung zur Prüfung anhalten"}),
        "due_soon": "Diese Rechnung muss innerhalb von 7 Tagen bezahlt werden.",
        "fraud_risk": ("Wie wahrscheinlich ist diese Rechnung betrügerisch?",
                       ["keins", "gering", "mäßig", "hoch", "sehr hoch"]),
        "priority": ("Wie schnell soll diese Rechnung bearbeitet werden?",
                     ["kann warten", "niedrig", "normal", "erhöht", "hoch", "sofort"]),
    },
}


def softmax(logits: list[float]) -> list[float]:
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max())
    return (e / e.sum()).tolist()


def score_logits(mu: int, levels: int) -> list[float]:
    """Gaussian-in-level logits around an integer mean clipped to the scale."""
    mu = min(max(mu, 0), levels - 1)
    return [-((lv - mu) ** 2) / (2 * SCORE_SD**2) for lv in range(levels)]


def _pick(rng: np.random.Generator, options) -> str:
    return options[int(rng.integers(len(options)))]


def _category_draw(rng: np.random.Generator) -> tuple[int, int | None, list[int]]:
    """Primary t, optional secondary s, and the candidate subset (t plus K-1 others, sorted)."""
    t = int(rng.integers(12))
    others = [j for j in range(12) if j != t]
    s = int(rng.choice(others)) if rng.random() < 0.5 else None
    k = int(rng.integers(2, 13))
    subset = sorted([t, *rng.choice(others, size=k - 1, replace=False).tolist()])
    return t, s, subset


def _subset_question(instructions: str, labels: tuple[str, ...], subset: list[int], t: int, s: int | None):
    logits = [3.5 * (j == t) + 1.5 * (j == s) for j in subset]
    return {"type": "choice", "instructions": instructions, "criteria": [labels[j] for j in subset]}, logits


def _described(kind: str, spec: tuple) -> dict:
    instructions, criteria = spec
    return {"type": kind, "instructions": instructions, "criteria": criteria}


def _support(rng: np.random.Generator, lang: str) -> tuple[dict, list[tuple[str, dict, list[float]]]]:
    t, s, subset = _category_draw(rng)
    tier, u, n = int(rng.integers(3)), int(rng.integers(3)), int(rng.integers(5))
    sla = bool(rng.random() < 0.3)
    kws = TOPIC_KEYWORDS[lang]
    mention = MENTION[lang][0].format(kw=_pick(rng, kws[s])) if s is not None else MENTION[lang][1]
    state = {
        "ticket_id": f"T-{int(rng.integers(100000, 1000000))}",
        "channel": _pick(rng, CHANNELS[lang]),
        "customer_tier": TIERS[lang][tier],
        "sla_breached": sla,
        "open_tickets": n,
        "subject": _pick(rng, SUBJECTS[lang]).format(kw=_pick(rng, kws[t])),
        "message": f"{_pick(rng, OPENINGS[lang])} {mention} {_pick(rng, TONES[lang][u])}",
        "note": _pick(rng, SUPPORT_NOTES[lang]),
    }
    text = TEXT[lang]
    ent, angry = int(tier == 2), int(u == 2)
    questions = [
        ("topic", *_subset_question(text["topic"], TOPICS[lang], subset, t, s)),
        ("queue", _described("choice", text["queue"]), [2.0, 4.0 * sla, 4.0 * ent, 4.0 * angry]),
        ("escalate", _described("noul", text["escalate"]), [0.0, -2.5 + 3 * sla + 2 * ent + 2 * angry]),
        ("recontact", {"type": "noul", "instructions": text["recontact"]}, [0.0, -2.0 + n + 1.5 * (u >= 1)]),
        ("urgency", _described("score", text["urgency"]), score_logits(sla + (u >= 1) + angry + ent, 4)),
        ("effort", _described("score", text["effort"]), score_logits((t in TECHNICAL) + (s is not None), 3)),
    ]
    return state, questions


def _invoice(rng: np.random.Generator, lang: str) -> tuple[dict, list[tuple[str, dict, list[float]]]]:
    t, s, subset = _category_draw(rng)
    band, u, n = int(rng.integers(3)), int(rng.integers(3)), int(rng.integers(1, 6))
    dup, new, po = bool(rng.random() < 0.2), int(rng.random() < 0.3), bool(rng.random() < 0.7)
    lo, hi = BAND_RANGES[band]
    kws = CATEGORY_KEYWORDS[lang]
    mention = INVOICE_MENTION[lang][0].format(kw=_pick(rng, kws[s])) if s is not None else INVOICE_MENTION[lang][1]
    state = {
        "invoice_no": f"INV-{int(rng.integers(2023, 2026))}-{int(rng.integers(10000, 100000))}",
        "vendor": _pick(rng, VENDORS),
        "vendor_status": VENDOR_STATUS[lang][new],
        "currency": _pick(rng, CURRENCIES),
        "amount": round(float(rng.uniform(lo, hi)), 2),
        "amount_band": BANDS[lang][band],
        "purchase_order": po,
        "duplicate_suspected": dup,
        "line_items": n,
        "description": _pick(rng, DESCRIPTIONS[lang]).format(kw=_pick(rng, kws[t])),
        "note": f"{mention} {_pick(rng, TERMS[lang][u])}",
    }
    text = TEXT[lang]
    no_po, big = 1 - int(po), int(band == 2)
    questions = [
        ("category", *_subset_question(text["category"], CATEGORIES[lang], subset, t, s)),
        ("approver", _described("choice", text["approver"]), [3.0 * (j == band) for j in range(3)]),
        ("hold", _described("noul", text["hold"]), [0.0, -3.0 + 4 * dup + 2 * new + 2 * no_po]),
        ("due_soon", {"type": "noul", "instructions": text["due_soon"]}, [0.0, -2.5 + 2.5 * u]),
        ("fraud_risk", _described("score", text["fraud_risk"]), score_logits(2 * dup + new + no_po + big, 5)),
        ("priority", _described("score", text["priority"]), score_logits(2 * u + big + (n >= 4), 6)),
    ]
    return state, questions


BUILDERS = {"support-triage": _support, "invoice-approval": _invoice}


def case_group(i: int) -> tuple[str, str]:
    """(workflow, language) of case i: round-robin so the four groups stay balanced."""
    return WORKFLOWS[i % len(WORKFLOWS)], LANGUAGES[(i // len(WORKFLOWS)) % len(LANGUAGES)]


def vote_target(posterior: list[float], votes: int, rng: np.random.Generator) -> list[float]:
    """Mean of `votes` one-hot draws from the posterior."""
    counts = rng.multinomial(votes, np.asarray(posterior) / np.sum(posterior))
    return (counts / votes).tolist()


def generate_case(i: int, seed: int, votes: int | None = None) -> list[Record]:
    """The records (one per question) of case i; independent of how many cases are generated."""
    workflow, lang = case_group(i)
    state, questions = BUILDERS[workflow](np.random.default_rng([seed, i]), lang)
    vote_rng = np.random.default_rng([seed, i, 1])
    case_id = f"synth-{seed}-{i:05d}"
    records = []
    for qid, question, logits in questions:
        posterior = softmax(logits)
        target = posterior if votes is None else vote_target(posterior, votes, vote_rng)
        records.append(Record(
            id=f"{case_id}:{qid}", source=SOURCE, language=lang, task=workflow, state=state,
            question=question, target=target, posterior=posterior, case_id=case_id,
        ))
    return records


def generate(n_cases: int, seed: int, votes: int | None = None) -> list[Record]:
    """`n_cases` known-posterior cases (six records each), deterministic in `seed`."""
    if votes is not None and votes < 1:
        raise ValueError("votes must be >= 1")
    return [r for i in range(n_cases) for r in generate_case(i, seed, votes)]
