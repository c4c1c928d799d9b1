"""Static files of the built-in /dashboard page (a package so they ship as package data)."""
