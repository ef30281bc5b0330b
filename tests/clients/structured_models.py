"""Nested Pydantic models the client-library tests ask the gateway for (tool arguments and structured output).

Only pydantic is imported here: the instructor test loads this file in its own virtualenv as well. The reference
model writes meaningless text, so every free value is bounded (enums, ``max_length``, number ranges, short lists):
output constrained by the schema always validates, and a field the gateway leaves unconstrained soon does not.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Word = Annotated[str, Field(max_length=12)]


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    city: Word
    country: Literal["fr", "de", "jp"]


class Forecast(BaseModel):
    """A weather forecast for one place."""

    place: Place
    unit: Unit
    days: int = Field(ge=1, le=7)
    tags: list[Word] = Field(max_length=3)
    summary: str = Field(max_length=24)  # a top-level string: forced tool calls write it as raw text


class Passenger(BaseModel):
    name: Word
    age: int = Field(ge=0, le=120)


class BookTrip(BaseModel):
    """Books a trip for a group of passengers."""

    destination: Place
    passengers: list[Passenger] = Field(min_length=1, max_length=2)
    budget: int = Field(ge=10, le=5000)  # a float's fraction would be as long as the model keeps writing digits
    seat: Literal["window", "aisle"] | None = None
    note: str = Field(max_length=20)


def check_forecast(forecast: Forecast) -> None:
    """The bounds hold on the parsed object (pydantic checked them already; this states what the tests rely on)."""
    assert isinstance(forecast, Forecast)
    assert 1 <= forecast.days <= 7
    assert forecast.unit in set(Unit)
    assert forecast.place.country in ("fr", "de", "jp") and len(forecast.place.city) <= 12
    assert len(forecast.tags) <= 3 and all(len(tag) <= 12 for tag in forecast.tags)
    assert len(forecast.summary) <= 24


def check_trip(trip: BookTrip) -> None:
    assert isinstance(trip, BookTrip)
    assert trip.destination.country in ("fr", "de", "jp") and len(trip.destination.city) <= 12
    assert 1 <= len(trip.passengers) <= 2
    assert all(0 <= p.age <= 120 and len(p.name) <= 12 for p in trip.passengers)
    assert 10 <= trip.budget <= 5000
    assert trip.seat in ("window", "aisle", None)
    assert len(trip.note) <= 20
