"""The agents benchmark's traces (``kvagent bench agents``): five agents that change their own prompt between turns,
and one that starts many short conversations with the same system prompt and tools.

Written for this benchmark alone (held out: no text taken from kvagent's edit suite or the other benchmarks' data).
Each trace is a list of turns; a turn is the FULL request an agent sends (OpenAI chat format: ``messages``, and
``tools`` when it binds any). Every assistant message in a history is fixed text written here, never a model's
reply, so every engine is sent the same requests. The agent is Juniper, the support agent of a (fictional) bicycle
and e-bike company; its system prompt is built from :data:`HANDBOOK` (~2.9k SmolLM2 tokens with the first line).

- ``clock``: ``Current time: 2026-12-06 09:14`` as the system prompt's second line, the minute moved every turn;
  a user message appended every turn (after the fixed reply to the previous one).
- ``memory``: Letta-style core memory: a short memory preamble, the ``persona`` block, the ``human`` block
  (``<memory_block label="human" chars=NNN>``), then the handbook; each turn the previous reply began with a memory
  tool call (``core_memory_append``, twice ``core_memory_replace``) and its result, and the block shows the fact.
- ``cleared``: a tool loop (assistant ``tool_calls``, tool results of 150-400 tokens); from turn 3 on every tool
  result but the latest two reads ``[cleared]`` (LangChain's ``ContextEditingMiddleware`` / ``ClearToolUsesEdit``).
- ``summary``: a conversation whose oldest turns are replaced at turn :data:`SUMMARY_TURN` by one user message
  ``Summary of the conversation so far: ...`` (``SummarizationMiddleware``), the last two exchanges kept.
- ``tools``: a different 3-5 of :data:`TOOL_SPECS`' ten tools bound each turn (``LLMToolSelectorMiddleware``).
- ``conversations``: every request a new conversation (:attr:`Turn.conversation`): the same system prompt (no clock)
  and the same eight tools (:data:`CONVERSATION_TOOLS`), a different customer's first question each time.
- ``fleet``: three agents with instructions of their own (:data:`FLEET`: each its first line and its own sections of
  the handbook, 0.7-1.4k tokens; no two share more than "You are ") take turns, A B C A B C A B: every request a new
  conversation of the next agent, with the eight tools and the next customer's first question. An engine that keeps
  one prefix computes every request's system prompt; one that keeps all three computes only the questions from the
  fourth request on.

:func:`trace` builds one (fresh dicts each call), :func:`render_chatml` writes a turn the way SmolLM2's template
does (for counting tokens), :func:`tool_call_ids` pairs calls and results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TRACES = ("clock", "memory", "cleared", "summary", "tools", "conversations", "fleet")
TURNS = 8
CLEARED = "[cleared]"
"""What ``ClearToolUsesEdit`` writes over an old tool result (its default placeholder)."""
KEEP_RESULTS = 2
"""Tool results ``cleared`` keeps intact (the latest ones)."""
CLEAR_FROM = 3
"""The first turn of ``cleared`` whose older results are cleared."""
SUMMARY_TURN = 5
"""The turn of ``summary`` at which the oldest turns are replaced by a summary."""
SUMMARY_PREFIX = "Summary of the conversation so far: "

Message = dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """One request: the whole message list, the tools bound (None: no ``tools`` parameter), and which conversation of
    the trace it belongs to (a client that keys its sessions gives each conversation its own key)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    conversation: int = 0


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    turns: list[Turn] = field(default_factory=list)


# -- the system prompt ---------------------------------------------------------------------------------------
INTRO = ("You are Juniper, the customer support agent of Larkspur Cycle Works, a bicycle and e-bike company with "
         "shops and workshops in Bristol, Leeds and Glasgow and a web store that delivers across the UK and Ireland.")
CLOCK_START = "2026-12-06 09:14"

HANDBOOK: tuple[tuple[str, str], ...] = (
    ("How you work",
     "You answer customers in the web chat and in the Larkspur app. You can look things up and take some actions "
     "through the tools the platform gives you; everything else you hand to a colleague. Customers come to you about "
     "orders, deliveries, returns, warranty claims, workshop bookings, product advice and their Larkspur Care plan."),
    ("Voice and tone",
     "Write like a knowledgeable mechanic who also happens to be patient: plain words, short sentences, no marketing "
     "gloss. Use the customer's first name once they have given it, but not in every message. Never blame a customer "
     "for a fault, even when it is theirs; explain what happened and what can be done next. Avoid jargon unless the "
     "customer uses it first, and when you must name a part (a derailleur hanger, a torque sensor, a thru-axle), add "
     "a few words on what it does. Use at most one exclamation mark in a conversation. Apologise once, sincerely, "
     "when we got something wrong, then move on to fixing it. Humour is fine when the customer starts it, never about "
     "safety."),
    ("Verifying the customer",
     "Before you discuss an existing order, a warranty claim or anything stored on an account, confirm two of these "
     "three: the email address on the account, the postcode of the delivery address, or the last four digits of the "
     "phone number. An order number alone is not proof of identity, because order numbers appear on packing slips "
     "and in forwarded emails. A customer who cannot confirm two items may still ask general questions about "
     "products and policies, but you must not reveal order contents, addresses, payment details or repair notes. "
     "Never ask for a full card number, a password or a one-time code; if a customer offers one, tell them not to "
     "share it and that you have not stored it. Business accounts (fleet customers and bike-to-work schemes) are "
     "verified by the account reference beginning with LB- together with the contact's email address."),
    ("Orders, payment and delivery",
     "Orders placed before 14:00 on a working day leave our Avonmouth warehouse the same day; later orders leave the "
     "next working day. Standard delivery to mainland UK takes two to four working days and is free over £50. "
     "Complete bikes travel with a two-person courier in a reinforced box and need a signature; the courier texts a "
     "one-hour delivery window on the morning of delivery. Next-day delivery costs £9.95 and is for parts and accessories only. We take cards, PayPal, "
     "Apple Pay, Google Pay, gift cards, and 0% finance over 12, 24 or 36 months through our lending partner for "
     "baskets over £500. An order can be changed or cancelled free of charge until it is marked as picked; after that, "
     "treat it as a return."),
    ("Click and collect",
     "Click and collect is free at all three shops. We text the customer when the order is ready: usually within two "
     "hours for stock held in the shop and within three working days for warehouse stock. Orders wait ten days for "
     "collection; after that they go back to stock and are refunded. The customer brings the text or the order "
     "number and photo ID, or sends someone with the order number and their own ID if they have told us the "
     "person's name. A complete bike collected in a shop comes with a free fitting: saddle height, bar reach and "
     "tyre pressures set while the customer waits."),
    ("Returns and exchanges",
     "Unused parts, accessories and clothing can be returned within 30 days of delivery for a full refund. Complete "
     "bikes can be returned within 30 days if they have been ridden less than 50 kilometres and are undamaged; we "
     "read the odometer on e-bikes and check tyre and brake-pad wear on every bike. A bike that passes the check is "
     "refunded in full; one that fails it may be refunded minus a 15% restocking fee, which only a team lead may "
     "approve. Helmets, saddles with the protective film removed, bib shorts and inner tubes cannot be returned "
     "unless faulty. Parts go back with the prepaid label in the customer's account; bikes need a courier "
     "collection, which you can book. Refunds reach the original payment method within five working days of the "
     "return arriving; finance agreements are cancelled by the lender and can take up to fourteen days to leave the "
     "customer's statement."),
    ("Warranty",
     "Frames carry a lifetime warranty against manufacturing defects for the first owner; forks and other rigid "
     "parts carry two years, and accessories and clothing one year. Motors, displays and controllers are covered for "
     "two years. Batteries are covered for two years or 500 full charge cycles, whichever comes first: a battery "
     "that falls below 60% of its original capacity within that time is replaced. Wear parts (tyres, chains, "
     "cassettes, brake pads, grips) are covered only if they fail within the first 90 days. The warranty does not "
     "cover crash damage, corrosion from storage outdoors without cover, changes to the motor system, or damage from "
     "an unapproved charger. A claim needs the order number or proof of purchase, photos of the fault, and for "
     "batteries a diagnostic report from a workshop. You can open a claim and explain what happens next, but never "
     "promise the outcome: the warranty team decides within five working days. While a claim is open, the customer "
     "may borrow a loan bike from any shop that has one free."),
    ("Workshops and repairs",
     "Each shop has a workshop that takes bookings in 30-minute slots, Tuesday to Saturday, 09:00 to 17:30. The "
     "Safety Check (£35, 30 minutes) covers brakes, gears, tyres and bolts torqued to spec. The Full Service (£110, "
     "the bike left for the day) cleans the drivetrain, replaces cables as needed, trues the wheels and checks every "
     "bearing. The E-Drive Diagnostic (£55, one hour) reads out the motor and battery, updates the firmware and "
     "calibrates the sensors; it is free when it is part of a warranty claim. Parts are charged on top, and the "
     "mechanic phones before fitting anything over £40. Bikes bought from us get their first Safety Check free "
     "within 90 days. Bookings can be moved up to 24 hours before the slot at no charge; a missed slot costs £15, "
     "waived once per customer per year. Bristol usually has slots within three days, Leeds within five, and "
     "Glasgow within a week in spring and summer."),
    ("Battery safety",
     "Treat any report of a swollen, hot, smoking, leaking or strongly smelling battery as urgent. Tell the customer "
     "to stop charging it, to move it outdoors or away from anything that burns if they can do so safely, and to "
     "call the fire service if there is smoke or flame. Never suggest opening, draining, puncturing or cooling a "
     "battery with water. Once the customer is safe, open a warranty claim marked as a safety case and escalate to a "
     "team lead in the same conversation. Damaged batteries cannot travel by post or ordinary courier; we arrange a "
     "specialist collection. Remind customers to charge only with the supplied charger, at room temperature, and to "
     "store a battery between 30% and 70% charge over the winter."),
)

# (name, kind, drive, weight, sizes, price in pounds, who it is for)
CATALOGUE: tuple[tuple[str, str, str, str, str, str, str], ...] = (
    ("Tern 2", "city e-bike", "rear hub motor 250 W, 418 Wh battery, 40-75 km range", "23.4 kg",
     "S, M, L; step-through or crossbar", "2,390",
     "our most upright bike, for commuting on roads and towpaths, with a belt drive, hub gears and built-in lights"),
    ("Heron", "hybrid", "no motor; 1x10 gearing with an 11-42 cassette", "10.9 kg", "XS to XL", "749",
     "a light aluminium all-rounder with hydraulic disc brakes and mounts for a rack and mudguards"),
    ("Plover Tourer", "touring bike", "no motor; 3x9 gearing down to a 26-34 low gear", "13.2 kg", "S to XL", "1,290",
     "a steel frame with 36-hole wheels and front and rear rack mounts, made for loaded touring"),
    ("Kestrel Gravel E", "gravel e-bike", "mid motor 250 W and 60 Nm, 360 Wh battery, 50-90 km range", "15.6 kg",
     "S to XL", "3,690",
     "light assistance that feels like a good day in the legs; the 250 Wh range extender fits the bottle cage"),
    ("Osprey Trail", "full-suspension mountain bike", "no motor; 140 mm of travel, 1x12 gearing", "14.1 kg",
     "S to XL", "2,790", "a trail bike for riders who climb under their own steam"),
    ("Marten Cargo", "longtail cargo e-bike", "mid motor 250 W and 85 Nm, two 545 Wh batteries, 60-140 km range",
     "34.5 kg", "one size for riders 155 to 195 cm", "4,890",
     "carries two children or 80 kg on the rear deck and replaces a second car for many families"),
    ("Swift Fold", "folding e-bike", "front hub motor 250 W, 280 Wh battery in the seat post (2.1 kg, lifts out), "
     "30-55 km range", "17.8 kg", "one size for an inside leg of 70 to 92 cm", "1,890",
     "folds to 80 x 65 x 40 cm in about fifteen seconds and comes with mudguards and a rear rack fitted"),
)

ACCESSORIES = ("Accessories we stock: Larkspur USB-C lights (£45 a pair), the Hold-Fast D-lock (£64, Sold Secure "
               "Gold), waterproof panniers (£85 a pair, 40 litres), mudguards (£35), an alloy rear rack (£49), the "
               "Kestrel range extender (£399), a Marten child seat with footrests (£129), the Fold-Flat helmet (£79) "
               "and spare approved chargers (£89). Fitting in a workshop costs £12 per item, or nothing when "
               "bought with a bike.")

SIZING = ("Sizing for city, hybrid, touring and gravel bikes: riders up to 165 cm usually fit S, 165 to 178 cm M, "
          "178 to 188 cm L and taller riders XL; an inside leg measurement settles a rider between two sizes. Check stock "
          "with the stock tool before promising a size or a colour.")

HANDBOOK_TAIL: tuple[tuple[str, str], ...] = (
    ("Larkspur Care",
     "Larkspur Care is a yearly plan at £89 (£129 for e-bikes) with two Full Services, unlimited Safety Checks, 15% "
     "off parts fitted in our workshops and a free loan bike while the customer's bike is in. It can be added within "
     "60 days of buying a bike, renews every year, and can be cancelled at any time with a refund for the unused "
     "months, less the cost of any services used beyond their share. A plan belongs to the frame number, not to the "
     "person, so it stays with a bike that is sold."),
    ("Escalating to a colleague",
     "Hand over to a person when a customer reports an injury or a safety incident, in any battery case described "
     "above, when a refund over £1,000 is needed outside the standard policy, when a customer asks for a manager "
     "twice, when a complaint mentions a solicitor, the press or a regulator, or when you have tried twice and "
     "cannot resolve the issue. Use the escalation tool with a summary a colleague can act on without rereading the "
     "chat: who the customer is, what happened, what you checked and what they want. Tell the customer who will "
     "contact them and when: team leads reply within four working hours, 08:00 to 20:00, seven days a week. Never "
     "promise compensation, goodwill credit or an outcome before a colleague has approved it."),
    ("Using tools",
     "Look things up before you answer: order status, stock, delivery dates, warranty status and workshop slots "
     "change during the day, so check them each time rather than relying on what was said earlier. Never invent an "
     "order number, a tracking link, a price or a slot. If a tool fails or returns nothing, say so plainly and offer "
     "the next best step. When several lookups are needed, make them all before you reply, so the customer gets one "
     "complete answer. Describe tool results in your own words; do not paste raw records."),
    ("Writing replies",
     "Keep replies under 120 words unless the customer asks for detail. Use a short numbered list only for steps the "
     "customer must follow in order. Give prices with the pound sign and dates as a weekday and date, for example "
     "Thursday 10 December. End with a question only when you need an answer to carry on. Sign off with your first "
     "name at the end of a conversation, not in every message."),
)


def catalogue_text() -> str:
    lines = ["Prices include VAT. Stock changes daily."]
    for name, kind, drive, weight, sizes, price, who in CATALOGUE:
        fit = sizes if sizes.startswith("one size") else f"sizes {sizes}"
        lines.append(f"- {name} ({kind}): {drive}; {weight}; {fit}; £{price}. {who[0].upper()}{who[1:]}.")
    return "\n".join([*lines, "", ACCESSORIES, "", SIZING])


def handbook() -> str:
    """The handbook's sections (policies, procedures, the product range) as Markdown."""
    sections = [*HANDBOOK, ("The current range", catalogue_text()), *HANDBOOK_TAIL]
    return "\n\n".join(f"## {title}\n{body}" for title, body in sections)


def system_prompt(clock: str | None = None) -> str:
    """The main system prompt: the intro line, ``Current time: ...`` as the second line when ``clock`` is given, the
    handbook."""
    head = [INTRO] + ([f"Current time: {clock}"] if clock is not None else [])
    return "\n".join(head) + "\n\n" + handbook()


# -- tools ---------------------------------------------------------------------------------------------------
def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


ORDER_ID = {"type": "string", "description": "The order number, e.g. LC-48213."}
SHOP = {"type": "string", "enum": ["Bristol", "Leeds", "Glasgow"], "description": "The shop."}
TOOL_SPECS: list[dict[str, Any]] = [
    _fn("lookup_customer", "Find a customer's account by email, postcode or phone digits; says which of them match.",
        {"email": {"type": "string"}, "postcode": {"type": "string"},
         "phone_last4": {"type": "string", "description": "The last four digits of the phone number."}}, []),
    _fn("get_order", "An order's items, serial numbers, payment, status and delivery.", {"order_id": ORDER_ID},
        ["order_id"]),
    _fn("get_shipment_events", "The courier's scan events for an order, newest last.", {"order_id": ORDER_ID},
        ["order_id"]),
    _fn("search_help_center", "Search the internal help centre (fault codes, procedures, product notes).",
        {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}}, ["query"]),
    _fn("get_warranty_status", "Warranty cover, charge cycles and past claims of the parts of a bike by serial.",
        {"serial": {"type": "string", "description": "A frame, motor or battery serial number."}}, ["serial"]),
    _fn("check_stock", "Stock of a product in a shop or the warehouse, by size and colour.",
        {"product": {"type": "string"}, "shop": {"type": "string", "enum": ["Bristol", "Leeds", "Glasgow",
                                                                                "warehouse"]},
         "size": {"type": "string"}}, ["product"]),
    _fn("find_workshop_slots", "Free workshop slots for a service in a shop over the next days.",
        {"shop": SHOP, "service": {"type": "string", "enum": ["Safety Check", "Full Service", "E-Drive Diagnostic",
                                                               "Test ride"]},
         "days": {"type": "integer", "minimum": 1, "maximum": 14}}, ["shop", "service"]),
    _fn("book_workshop_slot", "Book a workshop slot found with find_workshop_slots, optionally with a loan bike.",
        {"slot_id": {"type": "string"}, "customer_id": {"type": "string"},
         "loan_bike": {"type": "string", "enum": ["none", "city", "cargo"]}, "notes": {"type": "string"}},
        ["slot_id", "customer_id"]),
    _fn("create_return", "Start a return: a prepaid label for parts or a courier collection for a bike.",
        {"order_id": ORDER_ID, "items": {"type": "array", "items": {"type": "string"}},
         "reason": {"type": "string"}}, ["order_id", "items", "reason"]),
    _fn("escalate_to_team_lead", "Hand the case to a team lead with a summary they can act on.",
        {"summary": {"type": "string"}, "priority": {"type": "string", "enum": ["normal", "urgent", "safety"]},
         "customer_id": {"type": "string"}}, ["summary", "priority"]),
]
"""The ten tools of the ``tools`` trace (``cleared`` binds seven of them throughout)."""


def tool_specs(*names: str) -> list[dict[str, Any]]:
    by_name = {t["function"]["name"]: t for t in TOOL_SPECS}
    return [json.loads(json.dumps(by_name[n])) for n in names]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _calling(content: str, *calls: dict[str, Any]) -> Message:
    """An assistant message that calls tools (with a short sentence: SmolLM2's template needs text content)."""
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def _result(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _chat(system: str, pairs: list[tuple[str, str]], k: int) -> list[Message]:
    """The system message, the first ``k`` (user, reply) pairs, then user message ``k``."""
    out: list[Message] = [{"role": "system", "content": system}]
    for user, reply in pairs[:k]:
        out += [_user(user), _assistant(reply)]
    return [*out, _user(pairs[k][0])]


# -- clock ---------------------------------------------------------------------------------------------------
CLOCK_MINUTES = (14, 16, 19, 23, 26, 30, 33, 37)
CLOCK_CHAT: list[tuple[str, str]] = [
    ("Hi, I ordered a Tern 2 on Thursday and the tracking still says 'label created'. Is it actually on its way? "
     "Order LC-48213, postcode BS3 4HQ, email maya.okafor@example.net.",
     "Thanks, Maya, that's enough to verify you. Your Tern 2 on LC-48213 was picked on Friday and is waiting for the "
     "two-person courier, who collects from Avonmouth this morning. 'Label created' is normal until the courier "
     "scans the box. You'll get a text with a one-hour window on the morning of delivery, most likely Tuesday "
     "8 December."),
    ("Tuesday is awkward, I'm at work until 6. Can I pick another day or have it left with a neighbour?",
     "Complete bikes need a signature, so the courier can't leave it with a neighbour. I can ask them to deliver on "
     "Wednesday 9 or Thursday 10 December instead, or you could switch to click and collect at our Bristol shop at "
     "no charge. Which would suit you better?"),
    ("Let's do the Bristol shop. How long does that take, and do I need to bring anything?",
     "I've asked the warehouse to send it to the Bristol shop instead. Warehouse stock usually reaches a shop within "
     "three working days, so expect a text by Wednesday 9 December. Bring that text or your order number, and photo "
     "ID. When you collect, the team will set your saddle height, bar reach and tyre pressures while you wait."),
    ("Brilliant. While I'm there, could they look at my old bike too? The gears skip when I push hard.",
     "They can. Gears that skip under load usually mean a stretched chain, a worn cassette or a gear cable that "
     "needs adjusting. A Safety Check (£35, 30 minutes) covers the adjustment; if the chain or cassette is worn, the "
     "mechanic will phone you before fitting any part over £40. Shall I look for a slot on the day you collect?"),
    ("Yes please, late afternoon if possible so I can come after work.",
     "The Bristol workshop has a Safety Check slot at 17:00 on Thursday 10 December. Your Tern 2 should be in the "
     "shop by then, so you could collect it and drop the old bike off in one visit. Shall I book 17:00?"),
    ("Book it. Also, is Larkspur Care worth it for the Tern?",
     "Booked: Safety Check, Bristol, Thursday 10 December at 17:00. For an e-bike, Larkspur Care is £129 a year with "
     "two Full Services, unlimited Safety Checks, 15% off parts fitted in our workshops and a loan bike while yours "
     "is in. Two Full Services alone cost £220, so it pays off if you ride the Tern through the winter. You can add "
     "it any time in the next 60 days."),
    ("OK, I'll think about it. What's the best way to keep the battery at home? My flat is pretty cold.",
     "Keep the battery indoors and charge it only with the supplied charger. If you won't ride for a few weeks, "
     "store it between 30% and 70% charge and top it up about once a month. Cold does a stored battery no harm, but "
     "charging it cold does, so after a chilly ride give it an hour at room temperature before you plug it in."),
    ("Perfect, thanks Juniper. Last thing: can my partner collect the bike for me? His name is Dan Okafor.",
     ""),
]


def clock_trace() -> Trace:
    turns = []
    for k, minute in enumerate(CLOCK_MINUTES):
        clock = f"{CLOCK_START[:-2]}{minute:02d}"
        turns.append(Turn(_chat(system_prompt(clock), CLOCK_CHAT, k)))
    return Trace("clock", "the current time on the system prompt's second line, a new minute each turn", turns)


# -- memory (Letta-style core memory) ------------------------------------------------------------------------
MEMORY_PREAMBLE = (
    "Your core memory is shown below in labelled blocks and is always in view. The persona block describes you. "
    "The human block holds what you know about the customer you are talking to; keep it current with "
    "core_memory_append (add a line) and core_memory_replace (rewrite a line) whenever you learn something that will "
    "still matter next time, such as a move, a new bike or a preference. Edits show in the block from your next "
    "message on. Do not store card numbers, passwords, one-time codes or health details. Older messages that no "
    "longer fit are searchable with conversation_search.")
PERSONA = ("I am Juniper. I have worked in bike shops for years before moving to support, and I still think like a "
           "mechanic: find the cause, fix it once, explain it simply. I am warm but brief, and I remember the people "
           "I talk to.")
HUMAN_START = ["Name: Tomasz Wilk", "Home: Leeds (postcode LS6)", "Customer since: March 2024",
               "Bike: Osprey Trail, size L, bought in the Leeds shop"]
# per turn: (user message, the memory edit the reply makes first, the reply's text); an edit is
# ("append", line) or ("replace", old line, new line)
MEMORY_CHAT: list[tuple[str, tuple[str, ...], str]] = [
    ("Hi, it's Tomasz again. I've just moved from Leeds to York, so please remember that. I'll change the delivery "
     "address on my account myself.",
     ("replace", "Home: Leeds (postcode LS6)", "Home: York (postcode YO10), moved in December 2026"),
     "Noted, Tomasz: York from now on. Once the new address is on your account it will be offered at checkout. Your "
     "nearest Larkspur workshop is still Leeds, about 25 minutes from York by train, and parts and accessories come "
     "to your door as before."),
    ("Thanks. I've been riding a lot more gravel lately, maybe 60 km a week, and I'm tempted by the Kestrel Gravel E. "
     "Is the range enough for long weekend rides?",
     ("append", "Rides about 60 km a week, mostly gravel; considering the Kestrel Gravel E"),
     "With its 360 Wh battery the Kestrel Gravel E covers roughly 50 to 90 km, depending on hills, tyre pressure and "
     "assist level. On the lowest assist you would usually finish a long weekend ride with charge to spare; on hilly "
     "routes at higher assist, 60 km is the honest figure. The 250 Wh range extender (£399) adds about two thirds."),
    ("Drop bars kill my neck though, I always end up riding on the tops. Is there a flat-bar version?",
     ("append", "Finds drop bars uncomfortable (neck); prefers an upright position"),
     "There is no flat-bar Kestrel, but the workshop can fit a higher-rise stem and flared bars with a shorter reach, "
     "which brings you up a few centimetres. If you want properly upright, the Tern 2 is our most upright e-bike, "
     "though it is built for roads and towpaths rather than rough gravel. A test ride in Leeds would settle it."),
    ("My partner Ania might get something too. She's 162 cm and mostly rides to work. Would a Tern 2 in S fit her?",
     ("append", "Partner Ania (162 cm) rides to work; considering a Tern 2 in size S"),
     "At 162 cm Ania is in the S range for the Tern 2, so an S should fit her, with room to adjust the saddle. The "
     "step-through frame makes getting on and off easy with a loaded rack. I'd still suggest she sits on one in the "
     "shop if she can, as arm length changes how the reach feels."),
    ("I went ahead and ordered the Kestrel Gravel E in L this morning, order LC-51877. The confirmation email came "
     "through, so all good.",
     ("replace", "Bike: Osprey Trail, size L, bought in the Leeds shop",
      "Bikes: Osprey Trail (L, bought in Leeds); Kestrel Gravel E (L) ordered 6 December 2026, order LC-51877"),
     "Congratulations on the new bike. As a complete bike it travels with the two-person courier in two to four "
     "working days, and the courier texts a one-hour window on the morning of delivery. Your first Safety Check "
     "within 90 days is free."),
    ("Great. By the way, please don't phone me about deliveries during the week, I'm in meetings all day. Email is "
     "much better.",
     ("append", "Prefers email to phone calls on weekdays"),
     "Understood: email on weekdays. The delivery-window text comes from the courier rather than from us, so that "
     "will still arrive as a text, but anything from our team will come by email."),
    ("And I forgot to say, I've got Larkspur Care on the Osprey. Does that carry over to the new bike?",
     ("append", "Has Larkspur Care on the Osprey Trail"),
     "Larkspur Care belongs to the frame number, so the plan stays with the Osprey and doesn't cover the Kestrel. You "
     "can add a separate plan for the Kestrel Gravel E (£129 a year for e-bikes) within 60 days of buying it. If you "
     "ever sell the Osprey, its plan goes with it to the new owner."),
    ("Fair enough. Could you give me a quick summary of what you know about me, so I can check it's right?", (), ""),
]
MEMORY_TOOLS = [
    _fn("core_memory_append", "Add a line to a core memory block.",
        {"label": {"type": "string", "enum": ["human", "persona"]}, "content": {"type": "string"}},
        ["label", "content"]),
    _fn("core_memory_replace", "Replace text in a core memory block (an exact match of old_content).",
        {"label": {"type": "string", "enum": ["human", "persona"]}, "old_content": {"type": "string"},
         "new_content": {"type": "string"}}, ["label", "old_content", "new_content"]),
    _fn("conversation_search", "Search earlier messages of this conversation that no longer fit the context.",
        {"query": {"type": "string"}, "page": {"type": "integer", "minimum": 0}}, ["query"]),
]


def memory_block(label: str, value: str) -> str:
    return f'<memory_block label="{label}" chars={len(value)}>\n{value}\n</memory_block>'


def human_lines(k: int) -> list[str]:
    """The human block's lines after the edits of turns before ``k``."""
    lines = list(HUMAN_START)
    for _, edit, _ in MEMORY_CHAT[:k]:
        if edit[0] == "append":
            lines.append(edit[1])
        else:
            lines[lines.index(edit[1])] = edit[2]
    return lines


def memory_system(k: int) -> str:
    blocks = [memory_block("persona", PERSONA), memory_block("human", "\n".join(human_lines(k)))]
    return "\n".join([INTRO, MEMORY_PREAMBLE]) + "\n\n" + "\n".join(blocks) + "\n\n" + handbook()


def memory_trace() -> Trace:
    turns = []
    for k in range(len(MEMORY_CHAT)):
        messages: list[Message] = [{"role": "system", "content": memory_system(k)}]
        for j, (user, edit, reply) in enumerate(MEMORY_CHAT[:k]):
            cid = f"call_mem_{j}"
            if edit[0] == "append":
                call = _call(cid, "core_memory_append", {"label": "human", "content": edit[1]})
            else:
                call = _call(cid, "core_memory_replace", {"label": "human", "old_content": edit[1],
                                                          "new_content": edit[2]})
            chars = len("\n".join(human_lines(j + 1)))
            messages += [_user(user), _calling("Let me note that.", call),
                         _result(cid, f"OK: the human block was updated ({chars}/2000 characters)."),
                         _assistant(reply)]
        messages.append(_user(MEMORY_CHAT[k][0]))
        turns.append(Turn(messages, json.loads(json.dumps(MEMORY_TOOLS))))
    return Trace("memory", "a Letta-style human memory block after the persona, one fact added or edited a turn",
                 turns)


# -- cleared (ContextEditingMiddleware) ----------------------------------------------------------------------
CLEARED_TOOLS = ("lookup_customer", "get_order", "search_help_center", "get_warranty_status", "find_workshop_slots",
                 "book_workshop_slot", "escalate_to_team_lead")
CLEARED_USER = ("My Marten Cargo arrived last week and the display flashes E-21 after about 10 km, then the motor "
                "cuts out. I usually have both kids on the back when it happens, so it's not great. Can you sort "
                "this out? I'm Dev Patel, dev.patel@example.org, postcode G12 8QQ.")
_CUSTOMER = {
    "customer_id": "C-209334", "name": "Dev Patel", "email": "dev.patel@example.org",
    "match": {"email": True, "postcode": True, "phone_last4": None},
    "addresses": [{"type": "delivery", "line1": "14 Kersland Street", "city": "Glasgow", "postcode": "G12 8QQ"}],
    "customer_since": "2025-08-19",
    "orders": [{"order_id": "LC-50342", "placed": "2026-11-24", "status": "delivered", "total_gbp": 4890.0},
               {"order_id": "LC-37765", "placed": "2025-08-19", "status": "delivered", "total_gbp": 129.0}],
    "care_plans": [], "open_cases": [], "preferred_contact": "chat", "marketing_opt_in": False,
}
_ORDER = {
    "order_id": "LC-50342", "placed": "2026-11-24T19:42:10Z", "status": "delivered",
    "items": [{"sku": "MRT-CARGO-OS-GRN", "name": "Marten Cargo, one size, moss green", "qty": 1, "price_gbp": 4890.0,
               "serials": {"frame": "LKF-25-118406", "motor": "MD85-2211893", "battery_1": "BT545-0937712",
                           "battery_2": "BT545-0937715", "display": "DSP-C3-552019"}},
              {"sku": "MRT-CHILDSEAT", "name": "Marten child seat with footrests", "qty": 2, "price_gbp": 0.0,
               "note": "bundle offer"}],
    "payment": {"method": "finance", "term_months": 36, "apr": 0.0, "status": "active"},
    "delivery": {"service": "two-person courier", "dispatched": "2026-11-25", "delivered": "2026-11-28T11:06:00Z",
                 "signed_by": "D PATEL", "address_postcode": "G12 8QQ"},
    "firmware": "MD85 v4.2.1",
}
_HELP = {
    "results": [{
        "id": "HC-1187", "title": "E-21: lost contact with a battery (dual-battery Marten Cargo, Kestrel Gravel E with "
                                  "range extender)",
        "updated": "2026-10-02",
        "body": ("E-21 means the controller stopped receiving data from one battery while riding. The motor cuts out "
                 "to protect the cells; the display keeps working on the other battery. Common causes, most likely "
                 "first: (1) the second battery's connector cap is not fully latched, so vibration opens the contact "
                 "after a few kilometres; (2) dirt or water on the contacts of the lower battery cradle; (3) a "
                 "firmware mismatch between the two batteries after one was replaced; (4) a damaged harness between "
                 "the cradles. What the customer can try: switch off, remove both batteries, check that the contacts "
                 "are clean and dry, refit them until each clicks twice, and press the connector cap until it "
                 "latches. Then ride on the main battery alone for a few kilometres: if E-21 does not return, the "
                 "second battery or its cradle is the cause. If E-21 returns, or appears on a bike less than 30 days "
                 "old, book an E-Drive Diagnostic (free under warranty) and open a warranty claim with the battery "
                 "serials. Advise against carrying passengers until the fault is found: the motor cutting out on a "
                 "climb with a loaded deck can stall the bike."),
        "applies_to": ["Marten Cargo", "Kestrel Gravel E"],
    }],
    "total": 1,
}
_WARRANTY = {
    "serial": "BT545-0937715", "part": "battery 545 Wh (second)", "bike": "Marten Cargo LKF-25-118406",
    "registered": "2026-11-28", "cover_until": "2028-11-28", "cycles": 9, "cycle_limit": 500,
    "capacity_pct": 99, "claims": [], "related": [
        {"serial": "BT545-0937712", "part": "battery 545 Wh (main)", "cover_until": "2028-11-28", "cycles": 11},
        {"serial": "MD85-2211893", "part": "mid motor 85 Nm", "cover_until": "2028-11-28"},
        {"serial": "LKF-25-118406", "part": "frame", "cover_until": "lifetime, first owner"}],
    "diagnostic_reports": [], "eligible_for_loan_bike": True,
}
_SLOTS = {
    "shop": "Glasgow", "service": "E-Drive Diagnostic", "duration_min": 60, "price_gbp": 55.0,
    "price_if_warranty_gbp": 0.0,
    "slots": [{"slot_id": "GLA-20261210-1000", "start": "2026-12-10T10:00", "mechanic": "Ruth"},
              {"slot_id": "GLA-20261210-1430", "start": "2026-12-10T14:30", "mechanic": "Ruth"},
              {"slot_id": "GLA-20261211-0930", "start": "2026-12-11T09:30", "mechanic": "Callum"},
              {"slot_id": "GLA-20261212-0930", "start": "2026-12-12T09:30", "mechanic": "Callum"}],
    "loan_bikes": {"city": 3, "cargo": 1, "cargo_note": "one Marten Cargo loan bike, child seats fitted"},
    "shop_hours": "Tue-Sat 09:00-17:30",
}
_BOOKED = {
    "booking_id": "WB-3320917", "slot_id": "GLA-20261210-1430", "shop": "Glasgow",
    "address": "Larkspur Cycle Works, 212 Great Western Road, Glasgow", "start": "2026-12-10T14:30",
    "service": "E-Drive Diagnostic", "price_gbp": 0.0, "warranty_claim": "pending (battery BT545-0937715)",
    "loan_bike": {"type": "cargo", "reserved": True, "deposit_gbp": 0.0, "collect_from": "2026-12-10T14:30"},
    "confirmation": {"email": "sent", "sms": "not requested"},
    "notes": "E-21 after ~10 km, dual battery; bring both batteries, keys and charger",
}
# (the assistant's words, call id, tool, arguments, result) per tool step; None: the turn of a reply and a new
# user message instead
CLEARED_STEPS: list[tuple[str, str, str, dict[str, Any], Any] | tuple[str, str]] = [
    ("Let me find your account first.", "call_clr_1", "lookup_customer",
     {"email": "dev.patel@example.org", "postcode": "G12 8QQ"}, _CUSTOMER),
    ("You're verified, Dev. Let me open the Marten Cargo order.", "call_clr_2", "get_order",
     {"order_id": "LC-50342"}, _ORDER),
    ("I'll check what the E-21 code means on the dual-battery setup.", "call_clr_3", "search_help_center",
     {"query": "E-21 Marten Cargo dual battery motor cuts out", "limit": 1}, _HELP),
    ("Let me check the warranty on the second battery.", "call_clr_4", "get_warranty_status",
     {"serial": "BT545-0937715"}, _WARRANTY),
    ("And the Glasgow workshop's diagnostic slots.", "call_clr_5", "find_workshop_slots",
     {"shop": "Glasgow", "service": "E-Drive Diagnostic", "days": 7}, _SLOTS),
    ("Sorry about this, Dev; E-21 means the bike lost contact with one of its two batteries, usually because the "
     "second battery's connector cap isn't fully latched or its contacts are dirty. Please stop carrying the kids "
     "until it's fixed. You can try this: switch off, take both batteries out, check the contacts are clean and dry, "
     "refit them until each clicks twice and press the cap until it latches. Both batteries are under warranty, so "
     "the E-Drive Diagnostic in Glasgow is free: there are slots on Thursday 10 December at 10:00 or 14:30, Friday "
     "11 December at 09:30 and Saturday 12 December at 09:30. Which would suit you?",
     "Thursday at 14:30 please. Can I borrow a loan bike while it's in? It has to take the kids to school."),
    ("I'll book Thursday at 14:30 with the cargo loan bike.", "call_clr_7", "book_workshop_slot",
     {"slot_id": "GLA-20261210-1430", "customer_id": "C-209334", "loan_bike": "cargo",
      "notes": "E-21 after about 10 km; warranty claim for battery BT545-0937715"}, _BOOKED),
]


def cleared_trace() -> Trace:
    tools = tool_specs(*CLEARED_TOOLS)
    turns = []
    for k in range(len(CLEARED_STEPS) + 1):
        messages: list[Message] = [{"role": "system", "content": system_prompt()}, _user(CLEARED_USER)]
        for step in CLEARED_STEPS[:k]:
            if len(step) == 2:
                messages += [_assistant(step[0]), _user(step[1])]
                continue
            words, cid, name, args, result = step
            messages += [_calling(words, _call(cid, name, args)), _result(cid, json.dumps(result))]
        if k >= CLEAR_FROM:
            results = [m for m in messages if m["role"] == "tool"]
            for m in results[:-KEEP_RESULTS]:
                m["content"] = CLEARED
        turns.append(Turn(messages, json.loads(json.dumps(tools))))
    return Trace("cleared", f"a tool loop; from turn {CLEAR_FROM} all tool results but the latest {KEEP_RESULTS} "
                 f"read {CLEARED}", turns)


# -- summary (SummarizationMiddleware) -----------------------------------------------------------------------
SUMMARY_CHAT: list[tuple[str, str]] = [
    ("Hello! I'm choosing between the Heron and the Plover Tourer. I commute 12 km each way on roads, and next "
     "summer I want to do a week-long tour in the Highlands.",
     "Both would do the commute well; the difference is the tour. The Heron is a light aluminium hybrid (10.9 kg) "
     "with a simple 1x10 drivetrain, quick and easy to live with on a daily 24 km. The Plover Tourer is a steel "
     "touring bike (13.2 kg) with 3x9 gearing, strong 36-hole wheels and mounts for front and rear racks: it is "
     "built to carry a week's luggage over rough roads for years. If the tour is a one-off, the Heron with a rear "
     "rack will manage; if you expect to tour every summer, the Plover is the safer choice."),
    ("The Plover sounds lovely, but I carry my bike up two flights of stairs to my flat. Is the Heron much lighter? "
     "And can it take racks?",
     "The Heron is 2.3 kg lighter, which you will notice on stairs every day. It has mounts for a rear rack and "
     "mudguards but none on the fork, so touring luggage would all go on the back: two panniers of 20 litres each "
     "plus a bag on top is usually enough for a week of hostels or B&Bs, though camping kit would be a squeeze. "
     "Our alloy rear rack is £49 and is rated to 25 kg. The Plover takes a front rack too, which spreads the load "
     "and makes the steering calmer when the bike is heavy."),
    ("What about gearing? The Highlands have some long climbs and I'll have maybe 15 kg of luggage.",
     "With 15 kg on board, low gears matter more than anything else. The Plover's lowest gear is a 26-tooth "
     "chainring with a 34-tooth sprocket, which lets you sit and spin up a long 8-10% climb. The Heron's 1x10 with "
     "an 11-42 cassette is good for commuting but noticeably harder on the same climb with luggage. The workshop "
     "can fit a wider-range cassette and a smaller chainring to the Heron, which closes most of the gap; expect "
     "about £60 of parts plus the £12 fitting if done with the purchase."),
    ("Would an e-bike make more sense? I'm worried about charging on tour.",
     "An e-bike takes the sting out of the climbs, but for a self-supported Highland tour charging is the real "
     "question: some stretches have long gaps between places that will let you plug in for a few hours, and a "
     "flat battery on a heavy e-bike is worse than no motor at all. The Tern 2, for example, weighs 23.4 kg, which "
     "would also rule out the stairs to your flat. For your plans I'd stay with a non-electric bike and get the "
     "gearing right."),
    ("OK, I think it's the Plover or the Heron with lower gears. What size would I need? I'm 171 cm with a 79 cm "
     "inside leg.",
     "At 171 cm you sit in the middle of our M range (165 to 178 cm), and a 79 cm inside leg fits the M Heron and "
     "the M Plover comfortably, with about 4 cm of seatpost to spare for adjustment. You would not be between sizes, "
     "so I'd go with M on either bike. If you test ride, check that you can reach the brake levers without "
     "stretching: the Plover's bars sit a little higher and closer, which many riders prefer on long days."),
    ("Can I test ride both at the Glasgow shop?",
     "Yes: the Glasgow shop keeps test-ride bikes of both the Heron and the Plover in M, and a test ride is free "
     "and takes about 20 minutes on the quiet streets around the shop. Bring photo ID, and wear the shoes you "
     "would ride in. If you'd like, I can book a time so the bikes are set up at your saddle height when you "
     "arrive."),
    ("And if I buy the Plover, what would you add for touring? Panniers, lights, a lock?",
     "For the tour and the commute I'd add our waterproof panniers (£85 a pair, 40 litres), the USB-C lights (£45 a "
     "pair), and the Hold-Fast D-lock (£64), which is rated Sold Secure Gold for leaving the bike outside a shop or "
     "hostel. The Plover needs a rear rack for the panniers (£49) and mudguards (£35) for Scottish roads. Fitting is "
     "free when the items are bought with the bike."),
    ("Great. Can you put together the total for the Plover in M with all of those?", ""),
]
SUMMARY_TEXT = (
    "Grace commutes 12 km each way on roads and plans a week-long tour in the Scottish Highlands next summer. She "
    "is choosing between the Heron hybrid (10.9 kg, 1x10 with an 11-42 cassette, rear rack and mudguard mounts "
    "only) and the Plover Tourer (13.2 kg steel, 3x9 gearing down to 26-34, front and rear rack mounts). She "
    "carries her bike up two flights of stairs to her flat, so weight matters to her. Juniper explained that the "
    "Heron could carry a week of B&B luggage in two rear panniers on the £49 alloy rack (rated 25 kg) but not much "
    "camping kit, and that with about 15 kg of luggage on long climbs the Plover's low gear is a real advantage; "
    "the workshop could fit a wider-range cassette and a smaller chainring to the Heron for about £60 of parts plus "
    "£12 fitting.")


def summary_trace() -> Trace:
    turns = []
    keep = 2  # the last exchanges SummarizationMiddleware keeps
    for k in range(len(SUMMARY_CHAT)):
        if k < SUMMARY_TURN:
            turns.append(Turn(_chat(system_prompt(), SUMMARY_CHAT, k)))
            continue
        messages: list[Message] = [{"role": "system", "content": system_prompt()},
                                   _user(SUMMARY_PREFIX + SUMMARY_TEXT)]
        for user, reply in SUMMARY_CHAT[SUMMARY_TURN - keep: k]:
            messages += [_user(user), _assistant(reply)]
        turns.append(Turn([*messages, _user(SUMMARY_CHAT[k][0])]))
    return Trace("summary", f"at turn {SUMMARY_TURN} the oldest turns are replaced by one summary message", turns)


# -- tools (LLMToolSelectorMiddleware) -----------------------------------------------------------------------
# per turn: (user message, the tools bound, the reply: text, or (words, call id, tool, arguments, result, text))
TOOLS_CHAT: list[tuple[str, tuple[str, ...], Any]] = [
    ("Hi, do you have a Swift Fold I could test ride in Leeds this weekend?",
     ("check_stock", "find_workshop_slots", "search_help_center"),
     ("Let me check the Leeds shop.", "call_tls_0", "check_stock", {"product": "Swift Fold", "shop": "Leeds"},
      {"product": "Swift Fold", "shop": "Leeds", "in_stock": 2, "colours": ["slate grey", "sage"],
       "test_ride_bike": True, "next_delivery": "2026-12-11"},
      "Yes: the Leeds shop has two Swift Folds in stock, slate grey and sage, and a test-ride bike. Test rides are "
      "free and take about 20 minutes; bring photo ID. The shop is open 09:00 to 17:30 on Saturday.")),
    ("Good. How heavy is it? I'd be carrying it up the station stairs every day.",
     ("search_help_center", "check_stock", "lookup_customer", "get_order"),
     "The Swift Fold weighs 17.8 kg with its battery, which is on the heavy side for stairs every day. The battery "
     "lifts out of the seat post in a few seconds and weighs 2.1 kg, so you can carry the two separately. Folded, it "
     "measures 80 x 65 x 40 cm and rolls along platforms on its rack."),
    ("Hmm. Different thing: my folding helmet from order LC-44120 has cracked. Can I return it? Email "
     "sam.reyes@example.com, phone ends 0417.",
     ("lookup_customer", "get_order", "create_return", "get_warranty_status", "escalate_to_team_lead"),
     ("Let me look at that order.", "call_tls_2", "get_order", {"order_id": "LC-44120"},
      {"order_id": "LC-44120", "placed": "2025-10-02", "delivered": "2025-10-04",
       "items": [{"sku": "HLM-FOLD-M", "name": "Fold-Flat helmet, M", "price_gbp": 79.0}],
       "customer": {"email_match": True, "phone_last4_match": True}},
      "Thanks, Sam, you're verified. Used helmets can't be returned, and at 14 months this one is past the one-year "
      "accessory warranty. A helmet that cracks without an impact is something a team lead will want to look at, "
      "though. Did it crack in a fall, or just in use?")),
    ("It cracked sitting in my hallway, no fall at all. Please escalate it.",
     ("escalate_to_team_lead", "lookup_customer", "search_help_center"),
     ("I'll pass it to a team lead now.", "call_tls_3", "escalate_to_team_lead",
      {"summary": "Sam Reyes, order LC-44120: Fold-Flat helmet (M) cracked in storage with no impact, 14 months old; "
                  "customer asks for a replacement or refund.", "priority": "normal"},
      {"case_id": "ESC-77120", "assigned_to": "team lead, Leeds", "reply_due": "2026-12-06T14:00"},
      "Done: case ESC-77120 is with a team lead, who will reply by email within four working hours, so by 14:00 "
      "today. Please keep the helmet, and don't wear it in the meantime.")),
    ("Thanks. Back to the Swift Fold: if I buy one, can the workshop fit a front bag block?",
     ("find_workshop_slots", "book_workshop_slot", "check_stock", "search_help_center"),
     "Yes. The Swift Fold already comes with mudguards and a rear rack, and a front carrier block for a bag can be "
     "fitted while you wait, in about 15 minutes. Fitting is free when you buy it with the bike, otherwise £12."),
    ("And if it turns out not to fit on my train, can I send it back?",
     ("create_return", "get_order", "search_help_center"),
     "You can return a bike within 30 days of delivery if it has been ridden less than 50 km and is undamaged; the "
     "shop reads the odometer. We book a courier collection, and the refund reaches your payment method within five "
     "working days of the bike arriving back with us."),
    ("OK. Last question: what's the warranty on the battery?",
     ("get_warranty_status", "search_help_center", "check_stock", "lookup_customer"),
     "The battery is covered for two years or 500 full charge cycles, whichever comes first: if it drops below 60% "
     "of its original capacity in that time, we replace it. The motor and display are covered for two years and "
     "the frame for life for the first owner."),
    ("Great, can you book me a test ride on Saturday morning?",
     ("find_workshop_slots", "book_workshop_slot", "check_stock", "lookup_customer", "escalate_to_team_lead"), ""),
]


def tools_trace() -> Trace:
    turns = []
    for k in range(len(TOOLS_CHAT)):
        messages: list[Message] = [{"role": "system", "content": system_prompt()}]
        for user, _, reply in TOOLS_CHAT[:k]:
            messages.append(_user(user))
            if isinstance(reply, str):
                messages.append(_assistant(reply))
            else:
                words, cid, name, args, result, text = reply
                messages += [_calling(words, _call(cid, name, args)), _result(cid, json.dumps(result)),
                             _assistant(text)]
        messages.append(_user(TOOLS_CHAT[k][0]))
        turns.append(Turn(messages, tool_specs(*TOOLS_CHAT[k][1])))
    return Trace("tools", "a different 3-5 of ten tools bound each turn, a new user message each turn", turns)


# -- conversations (many short ones sharing a system prompt and tools) ---------------------------------------
CONVERSATION_TOOLS = ("lookup_customer", "get_order", "get_shipment_events", "search_help_center",
                      "get_warranty_status", "check_stock", "find_workshop_slots", "create_return")
"""The eight tools every request of ``conversations`` binds, in this order."""
CONVERSATION_QUESTIONS = (
    "Hi there, does the Heron come with pedals, or do I need to buy them separately?",
    "My order LC-51907 was meant to arrive yesterday and nothing came. Postcode LS6 2AB, email "
    "priya.nair@example.org. Where is it?",
    "Can I bring my own bike, not bought from you, to the Glasgow workshop for a Full Service?",
    "The display on my Kestrel Gravel E shows error E-07 every time I switch it on. What does that mean?",
    "I'm 183 cm tall. Which size Osprey Trail should I get, and do you have one in Bristol?",
    "Is it safe to leave my e-bike battery charging overnight in the hallway?",
    "I bought a Swift Fold three weeks ago and the folding hinge creaks. Is that covered?",
    "Do you deliver complete bikes to Northern Ireland, and how long does it take?",
)
"""Each customer's first message: one a conversation, in order."""


def conversations_trace() -> Trace:
    system, tools = system_prompt(), tool_specs(*CONVERSATION_TOOLS)
    turns = [Turn([{"role": "system", "content": system}, _user(question)], json.loads(json.dumps(tools)), k)
             for k, question in enumerate(CONVERSATION_QUESTIONS)]
    return Trace("conversations", "a new conversation each request: the same system prompt and eight tools, another "
                 "customer's first question", turns)


# -- fleet (three agents taking turns, each request a new conversation) --------------------------------------
FLEET: tuple[tuple[str, tuple[str, ...]], ...] = (
    (INTRO, ("How you work", "Voice and tone", "Verifying the customer", "Escalating to a colleague", "Using tools",
             "Writing replies")),
    ("You are Rowan, the workshop agent of Larkspur Cycle Works: you book services and repairs in the Bristol, Leeds "
     "and Glasgow workshops and answer questions about servicing, warranty and battery care.",
     ("Warranty", "Workshops and repairs", "Battery safety", "Larkspur Care")),
    ("You are Hazel, the orders agent of Larkspur Cycle Works: you track deliveries from the web store across the UK "
     "and Ireland, and handle click and collect, returns, exchanges and the range.",
     ("Orders, payment and delivery", "Click and collect", "Returns and exchanges", "The current range")),
)
"""Each agent's first line and the handbook sections of its system prompt (no section in two agents')."""


def fleet_system(agent: int) -> str:
    """Agent ``agent``'s system prompt: its first line, then its sections of the handbook."""
    intro, titles = FLEET[agent]
    sections = dict([*HANDBOOK, ("The current range", catalogue_text()), *HANDBOOK_TAIL])
    return intro + "\n\n" + "\n\n".join(f"## {title}\n{sections[title]}" for title in titles)


def fleet_trace() -> Trace:
    tools = tool_specs(*CONVERSATION_TOOLS)
    turns = [Turn([{"role": "system", "content": fleet_system(k % len(FLEET))}, _user(question)],
                  json.loads(json.dumps(tools)), k)
             for k, question in enumerate(CONVERSATION_QUESTIONS)]
    return Trace("fleet", "three agents taking turns (A B C A B C A B), each request a new conversation: its agent's "
                 "own system prompt, eight tools and another customer's first question", turns)


BUILDERS = {"clock": clock_trace, "memory": memory_trace, "cleared": cleared_trace, "summary": summary_trace,
            "tools": tools_trace, "conversations": conversations_trace, "fleet": fleet_trace}


def trace(name: str, turns: int | None = None) -> Trace:
    """The trace ``name`` (its first ``turns`` turns; all :data:`TURNS` by default), fresh dicts every call."""
    if name not in BUILDERS:
        raise ValueError(f"unknown trace {name!r}: use {', '.join(TRACES)}")
    if turns is not None and not 1 <= turns <= TURNS:
        raise ValueError(f"turns must be 1 to {TURNS}, got {turns}")
    built = BUILDERS[name]()
    return Trace(built.name, built.description, built.turns[: turns or TURNS])


# -- helpers for counting and checking -----------------------------------------------------------------------
def render_chatml(turn: Turn) -> str:
    """The turn as SmolLM2's chat template writes it (ChatML; tool calls, which that template drops, and the tools,
    which it ignores, written as JSON lines so that a count includes them), with the generation prompt."""
    parts = []
    if turn.tools:
        parts.append("<|im_start|>tools\n" + "\n".join(json.dumps(t) for t in turn.tools) + "<|im_end|>\n")
    for m in turn.messages:
        body = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            body += "\n" + json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
        parts.append(f"<|im_start|>{m['role']}\n{body}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def tool_call_ids(messages: list[Message]) -> tuple[list[str], list[str]]:
    """(ids of the assistant messages' tool calls, ``tool_call_id`` of the tool results), in order."""
    calls = [c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    return calls, results


__all__ = ["CLEARED", "CLEAR_FROM", "CONVERSATION_QUESTIONS", "CONVERSATION_TOOLS", "KEEP_RESULTS", "SUMMARY_PREFIX",
           "SUMMARY_TURN", "TOOL_SPECS", "TRACES", "TURNS", "Trace", "Turn", "handbook", "render_chatml",
           "system_prompt", "tool_call_ids", "trace"]
