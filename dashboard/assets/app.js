// Placeholder: the web branch provides the dashboard script.
