"""The skills a chat model knows by name (its ``skills`` and ``skill_dirs`` files), and their segments checked
compiled for the model."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from kvagent.engine import Engine
from kvagent.segments import Segment
from kvagent.skills.spec import SkillSpec, load_skill, load_skills

from langchain_kvagent.errors import SkillNotCompiledError, UnknownSkillError


def skill_files(paths: Sequence[str | Path]) -> list[tuple[SkillSpec, Path]]:
    """(spec, file) of every skill in ``paths`` (files, or folders of ``*.yaml``/``*.yml``)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted([*p.glob("*.yaml"), *p.glob("*.yml")]) if p.is_dir() else [p]
    return list(zip(load_skills(files), files))


def find_skill(catalog: dict[str, tuple[SkillSpec, Path]],
               skill: str | Path | SkillSpec) -> tuple[SkillSpec, Path | None]:
    """A skill by name (in ``catalog``), YAML path, or spec; :class:`UnknownSkillError` naming the known ones."""
    if isinstance(skill, SkillSpec):
        return skill, None
    if str(skill) in catalog:
        return catalog[str(skill)]
    path = Path(skill)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_skill(path), path
    names = ", ".join(sorted(catalog)) or "none"
    raise UnknownSkillError(f"no skill named {str(skill)!r} (known: {names}): give a YAML path, or add its file "
                            "or folder to ChatKVAgent(skill_dirs=[...])")


def skill_segment(engine: Engine, spec: SkillSpec, path: Path | None, *, compile: bool, model: str) -> Segment:
    """``spec``'s segment, checked compiled for the engine's model (compiled first with ``compile``), on the
    engine's worker (compiling decodes; a lookup tokenizes)."""
    def work() -> Iterator[None]:
        renderer, library = engine.renderer(True), engine.skills
        if compile:
            return library.segment(spec, renderer)  # type: ignore[return-value]
        tokens = renderer.segment_tokens(spec.segment())
        if library.lookup(tokens) is None and not library.store.has(library.key(library.sink(renderer), tokens)):
            where = str(path) if path is not None else "SKILL.yaml"
            raise SkillNotCompiledError(
                f"skill {spec.name!r} is not compiled for {engine.model.name}: run `kvagent skills compile {where} "
                f"--model {model}` once, or construct ChatKVAgent(..., compile_skills=True)")
        return spec.segment()  # type: ignore[return-value]
        yield  # pragma: no cover - a unit of work that never pauses

    return engine.scheduler.run(None, work())  # type: ignore[arg-type, no-any-return]
