"""What the server's routes share (:class:`ServerState`): the engine, the tenants, the sessions, the skills, the
tool sets seen (:class:`~kvagent_server.tools.ToolCache`, one per tenant), the snapshot secret, the metrics.

The routes' modules (``chat``, ``sessions_api``) and the app (``app``) all read it; it imports none of them, so
dependencies run one way: ``app`` -> ``chat`` / ``sessions_api`` -> ``state`` -> ``sessions``.

What crosses tenants, and what does not (docs/server.md, "Tenants"): every session opens in its tenant's scope of
the prefix index and renders with its tenant's tokenizing memo; tool sets are cached per tenant; with a keys file,
each tenant compiles skills (its tools' descriptions) into a store of its own, and only the server's own skills
(``--skills``, compiled at start into the shared store) are read by every tenant. So the only KV that crosses
tenants is the server's own skills, transplanted from the store, never a tenant's prompt by prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from kvagent.aio import AsyncEngine
from kvagent.errors import SkillFileError
from kvagent.segments import Renderer
from kvagent.skills.library import SkillLibrary
from kvagent.skills.spec import SkillSpec, load_skill
from kvagent.skills.store import SkillStore

from kvagent_server.config import ServerConfig
from kvagent_server.metrics import Metrics
from kvagent_server.sessions import SessionManager, tenant_scope
from kvagent_server.tenants import Tenant, Tenants
from kvagent_server.tools import ToolCache


class TenantStore(SkillStore):
    """A tenant's compiled skills: its own folder, and the server's public skills (their keys in ``public_keys``)
    read from the shared ``public`` store. Nothing a tenant compiles is seen by another."""

    def __init__(self, root: Path, public: SkillStore, public_keys: frozenset[str]) -> None:
        super().__init__(root)
        self.public, self.public_keys = public, public_keys

    def has(self, key: str) -> bool:
        return (key in self.public_keys and self.public.has(key)) or super().has(key)

    def get(self, key: str, **kwargs: Any) -> Any:
        return self.public.get(key, **kwargs) if key in self.public_keys else super().get(key, **kwargs)

    def entry(self, key: str) -> Any:
        return self.public.entry(key) if key in self.public_keys else super().entry(key)


class ServerState:
    """What the routes share: the engine, the tenants, the sessions, the skills, the tool sets, the metrics."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine, metrics: Metrics, park_dir: Path,
                 tenants: Tenants, secret: bytes) -> None:
        self.config, self.engine, self.metrics, self.tenants, self.secret = config, engine, metrics, tenants, secret
        core = engine.engine
        self.core = core
        self.model_id = config.model if not config.model.endswith(".gguf") else core.model.name
        self.model_ids = {self.model_id, config.model, core.model.name}
        self.fingerprint = f"kvagent-{core.fingerprint[:16]}"
        self.skills: dict[str, SkillSpec] = load_skills(config.skills_dir)
        self.park_dir = park_dir
        self._libraries: dict[str, SkillLibrary] = {}
        self._tools: dict[str, ToolCache] = {}
        self.public_keys: frozenset[str] = frozenset()
        private = config.keys_file is not None  # several tenants: each compiles into its own store
        if private:
            self.public_keys = compile_public(core, self.skills.values())
        self.sessions = SessionManager(engine, metrics, park_dir, max_parked=config.max_parked,
                                       retry_after_s=config.retry_after_s, min_free_bytes=config.min_free_disk_mb << 20,
                                       compact_after=config.max_errata,
                                       libraries=self.library if private else None,
                                       session_idle_s=config.session_idle_s)

    def renderer(self, tenant: Tenant) -> Renderer:
        """The chat renderer of ``tenant``'s sessions (its own tokenizing memo)."""
        return self.core.renderer(True, tenant_scope(tenant))

    def library(self, tenant: Tenant) -> SkillLibrary:
        """The skill library of ``tenant``'s sessions: its own store under the park folder, plus the public skills."""
        found = self._libraries.get(tenant.name)
        if found is None:
            root = self.park_dir / "skills" / tenant.name
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            store = TenantStore(root, self.core.skills.store, self.public_keys)
            found = self._libraries[tenant.name] = self.core.skill_library(store)
        return found

    def tools(self, tenant: Tenant) -> ToolCache:
        """``tenant``'s cache of tool sets (compiled into its own library where tenants have their own)."""
        found = self._tools.get(tenant.name)
        if found is None:
            library = self.library(tenant) if self.config.keys_file is not None else None
            found = self._tools[tenant.name] = ToolCache(self.core, scope=tenant_scope(tenant), library=library)
        return found


def compile_public(core: Any, specs: Any) -> frozenset[str]:
    """Compile the server's own skills into the engine's (shared) store; their keys, which every tenant may read."""
    renderer = core.renderer(True)
    library = core.skills
    keys: list[str] = []

    def work() -> Iterator[None]:
        for spec in specs:
            skill, _ = library.compile(spec, renderer)
            keys.append(skill.key)
        return None
        yield  # pragma: no cover - a unit of work that never pauses

    core.scheduler.run(None, work())
    return frozenset(keys)


def load_skills(folder: Path | None) -> dict[str, SkillSpec]:
    """The skills of ``folder`` (``*.yaml``, ``*.yml``) by name; a bad file fails start-up, naming it."""
    if folder is None:
        return {}
    if not folder.is_dir():
        raise SkillFileError(f"--skills {folder}: not a folder")
    specs = [load_skill(p) for p in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])]
    return {spec.name: spec for spec in specs}
