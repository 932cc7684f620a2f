"""Sphinx + MyST configuration of meshlm's docs (docs/development.md says why Sphinx).

`sphinx-build -W --keep-going -n -b html docs OUT` builds the site; tests/test_docs.py runs
it so that a broken link, reference or generated page fails the suite. The reference pages
are filled in at build time from the code (docs/gen_reference.py): nothing there is
written by hand.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import gen_reference  # pylint: disable=wrong-import-position

project = 'meshlm'
extensions = ['myst_parser']
source_suffix = {'.md': 'markdown'}
exclude_patterns = ['_build']
myst_heading_anchors = 3          # [text](page.md#a-heading) links are checked
html_theme = 'alabaster'
html_theme_options = {'description': 'Train and serve Llama-style LLMs on any JAX mesh',
                      'fixed_sidebar': True}
html_sidebars = {'**': ['about.html', 'navigation.html', 'searchbox.html']}
smartquotes = False          # JSON and code in table cells keep their quotes


def setup(app):
  app.connect('source-read', gen_reference.fill_page)
