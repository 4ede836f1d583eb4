"""What the server's routes share (:class:`ServerState`): the engine, the sessions, the skills, the tool sets
seen (:class:`~kvagent_server.tools.ToolCache`), the metrics.

The routes' modules (``chat``, ``sessions_api``) and the app (``app``) all read it; it imports none of them, so
dependencies run one way: ``app`` -> ``chat`` / ``sessions_api`` -> ``state`` -> ``sessions``.
"""

from __future__ import annotations

from pathlib import Path

from kvagent.aio import AsyncEngine
from kvagent.errors import SkillFileError
from kvagent.skills.spec import SkillSpec, load_skill

from kvagent_server.config import ServerConfig
from kvagent_server.metrics import Metrics
from kvagent_server.sessions import SessionManager
from kvagent_server.tools import ToolCache


class ServerState:
    """What the routes share: the engine, the sessions, the skills, the tool sets, the metrics."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine, metrics: Metrics, park_dir: Path) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        core = engine.engine
        self.model_id = config.model if not config.model.endswith(".gguf") else core.model.name
        self.model_ids = {self.model_id, config.model, core.model.name}
        self.fingerprint = f"kvagent-{core.fingerprint[:16]}"
        self.renderer = core.renderer(True)
        self.skills: dict[str, SkillSpec] = load_skills(config.skills_dir)
        self.tools = ToolCache(core)
        self.sessions = SessionManager(engine, metrics, park_dir, max_parked=config.max_parked,
                                       retry_after_s=config.retry_after_s)


def load_skills(folder: Path | None) -> dict[str, SkillSpec]:
    """The skills of ``folder`` (``*.yaml``, ``*.yml``) by name; a bad file fails start-up, naming it."""
    if folder is None:
        return {}
    if not folder.is_dir():
        raise SkillFileError(f"--skills {folder}: not a folder")
    specs = [load_skill(p) for p in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])]
    return {spec.name: spec for spec in specs}


