"""launch/gpu_suite.sh without a GPU: the step lists name steps that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_patterns():
    """Every step name of the suite as a regex (a shell variable in a name matches a word)."""
    text = (ROOT / 'launch' / 'gpu_suite.sh').read_text()
    names = re.findall(r'\bstep "([^"]+)"', text)
    assert len(names) > 100
    return [re.compile(re.sub(r'\\\$\w+|\\\$\\\{\w+\\\}', lambda m: r'\S+', re.escape(n)) + r'\Z') for n in names]


def test_verify_steps_name_suite_steps():
    patterns = step_patterns()
    lines = [ln for ln in (ROOT / 'launch' / 'verify_steps.txt').read_text().splitlines()
             if ln and not ln.startswith('#')]
    assert len(lines) >= 50
    unknown = [ln for ln in lines if not any(p.match(ln) for p in patterns)]
    assert not unknown, f'launch/verify_steps.txt names steps that launch/gpu_suite.sh lacks: {unknown}'
    assert len(set(lines)) == len(lines)


def test_step_patterns_reject_other_names():
    patterns = step_patterns()
    assert any(p.match('ep np=1 top-9') for p in patterns)
    assert not any(p.match('ep np=1 top-9 and more words that no step has') for p in patterns)
