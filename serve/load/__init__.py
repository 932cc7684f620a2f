"""Loading what is served: a train.py run's checkpoint or a Hugging Face directory."""
