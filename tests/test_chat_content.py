"""Which chat templates read message contents as lists of parts (vLLM's "auto" content format)."""

from __future__ import annotations

import pytest

from tokenmill.chat_content import formatted_messages, template_loops_over_content

PRINTS_CONTENT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
CHECKS_THEN_PRINTS = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}"
                      "{% else %}{{ m.content[0]['text'] }}{% endif %}{% endfor %}")
LOOPS_DIRECTLY = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
LOOPS_BY_ATTRIBUTE = "{% for m in messages %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}"
LOOPS_FILTERED = ("{% for m in messages %}{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ part['text'] }}{% endfor %}{% endfor %}")
LOOPS_THROUGH_A_VARIABLE = ("{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p.text }}"
                            "{% if loop.last %}{% break %}{% endif %}{% endfor %}{% endfor %}")


@pytest.mark.parametrize("template, loops", [
    (PRINTS_CONTENT, False), (CHECKS_THEN_PRINTS, False), (LOOPS_DIRECTLY, True), (LOOPS_BY_ATTRIBUTE, True),
    (LOOPS_FILTERED, True), (LOOPS_THROUGH_A_VARIABLE, True), ("{% for m in messages %}{{ m.content }", False),
])
def test_template_loops_over_content(template, loops):
    assert template_loops_over_content(template) is loops


def test_formatted_messages_leave_the_callers_messages_alone():
    messages = [{"role": "user", "content": ["a", {"type": "refusal", "refusal": "no"}], "name": "x"}]
    assert formatted_messages(messages, "string", "m") == [{"role": "user", "content": "a\nno", "name": "x"}]
    assert formatted_messages(messages, "openai", "m")[0]["content"] == [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "no"}]
    assert messages[0]["content"][0] == "a"  # unchanged
    with pytest.raises(ValueError, match=r"m\[0\].content\[1\].text must be a string, got int"):
        formatted_messages([{"role": "user", "content": ["a", {"type": "text", "text": 3}]}], "string", "m")
