"""Image captions in English, German and French, written from a small hand-made grammar: the tests' parallel corpus.

Why: the tests need real language (inflection, word order that differs between the sides, sentence lengths that
vary) but must not need a corpus from outside the repository. Every caption is built as a structure (who does what,
where) and then rendered in each language with its own agreement rules, so the sides are true translations of each
other: "A young man in a red shirt is reading a book in the park." / "Ein junger Mann in einem roten Hemd liest ein
Buch im Park." / "Un jeune homme en chemise rouge lit un livre dans le parc." A German word may have synonyms; a
second rendering that picks among them is a second, independent reference of the same sources.

Written for mtkit's tests; the vocabulary is everyday words, nothing is taken from a corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

LANGS = ("en", "de", "fr")
MASC, FEM, NEUT = "m", "f", "n"


@dataclass(frozen=True)
class German:
    singular: str
    plural: str
    gender: str


@dataclass(frozen=True)
class Noun:
    en: tuple[str, str]  # singular, plural
    de: tuple[German, ...]  # synonyms, the first the usual word
    fr: tuple[str, str, str]  # singular, plural, gender
    kind: str  # person, animal or thing

    @property
    def fr_vowel(self) -> bool:
        return self.fr[0][0] in "aeiouhé"


def _noun(en: str, de: str, fr: str, kind: str, *synonyms: str) -> Noun:
    """``de`` and each synonym as "Singular/Plural/gender", ``fr`` as "singulier/pluriel/genre"."""
    en_sg, _, en_pl = en.partition("/")
    fr_sg, fr_pl, fr_gender = fr.split("/")
    german = tuple(German(*word.split("/")) for word in (de, *synonyms))
    return Noun((en_sg, en_pl or en_sg + "s"), german, (fr_sg, fr_pl, fr_gender), kind)


PEOPLE = [
    _noun("man/men", "Mann/Männer/m", "homme/hommes/m", "person"),
    _noun("woman/women", "Frau/Frauen/f", "femme/femmes/f", "person"),
    _noun("child/children", "Kind/Kinder/n", "enfant/enfants/m", "person"),
    _noun("boy", "Junge/Jungen/m", "garçon/garçons/m", "person"),
    _noun("girl", "Mädchen/Mädchen/n", "fille/filles/f", "person"),
    _noun("worker", "Arbeiter/Arbeiter/m", "ouvrier/ouvriers/m", "person"),
    _noun("musician", "Musiker/Musiker/m", "musicien/musiciens/m", "person"),
    _noun("cyclist", "Radfahrer/Radfahrer/m", "cycliste/cyclistes/m", "person"),
    _noun("tourist", "Tourist/Touristen/m", "touriste/touristes/m", "person"),
    _noun("student", "Student/Studenten/m", "étudiant/étudiants/m", "person"),
    _noun("cook", "Koch/Köche/m", "cuisinier/cuisiniers/m", "person"),
    _noun("police officer", "Polizist/Polizisten/m", "policier/policiers/m", "person"),
    _noun("teacher", "Lehrer/Lehrer/m", "professeur/professeurs/m", "person"),
    _noun("doctor", "Arzt/Ärzte/m", "médecin/médecins/m", "person"),
    _noun("farmer", "Bauer/Bauern/m", "fermier/fermiers/m", "person", "Landwirt/Landwirte/m"),
    _noun("painter", "Maler/Maler/m", "peintre/peintres/m", "person"),
    _noun("dancer", "Tänzer/Tänzer/m", "danseur/danseurs/m", "person"),
    _noun("baby/babies", "Baby/Babys/n", "bébé/bébés/m", "person"),
    _noun("runner", "Läufer/Läufer/m", "coureur/coureurs/m", "person"),
    _noun("firefighter", "Feuerwehrmann/Feuerwehrleute/m", "pompier/pompiers/m", "person"),
    _noun("fisherman/fishermen", "Fischer/Fischer/m", "pêcheur/pêcheurs/m", "person", "Angler/Angler/m"),
    _noun("soldier", "Soldat/Soldaten/m", "soldat/soldats/m", "person"),
    _noun("singer", "Sänger/Sänger/m", "chanteur/chanteurs/m", "person"),
    _noun("photographer", "Fotograf/Fotografen/m", "photographe/photographes/m", "person"),
    _noun("grandmother", "Großmutter/Großmütter/f", "grand-mère/grands-mères/f", "person", "Oma/Omas/f"),
    _noun("lady/ladies", "Dame/Damen/f", "dame/dames/f", "person"),
    _noun("nurse", "Krankenschwester/Krankenschwestern/f", "infirmière/infirmières/f", "person"),
    _noun("waiter", "Kellner/Kellner/m", "serveur/serveurs/m", "person"),
]
ANIMALS = [
    _noun("dog", "Hund/Hunde/m", "chien/chiens/m", "animal"),
    _noun("cat", "Katze/Katzen/f", "chat/chats/m", "animal"),
    _noun("horse", "Pferd/Pferde/n", "cheval/chevaux/m", "animal"),
    _noun("bird", "Vogel/Vögel/m", "oiseau/oiseaux/m", "animal"),
    _noun("cow", "Kuh/Kühe/f", "vache/vaches/f", "animal"),
    _noun("sheep/sheep", "Schaf/Schafe/n", "mouton/moutons/m", "animal"),
    _noun("duck", "Ente/Enten/f", "canard/canards/m", "animal"),
    _noun("goat", "Ziege/Ziegen/f", "chèvre/chèvres/f", "animal"),
    _noun("monkey", "Affe/Affen/m", "singe/singes/m", "animal"),
    _noun("rabbit", "Kaninchen/Kaninchen/n", "lapin/lapins/m", "animal", "Hase/Hasen/m"),
    _noun("camel", "Kamel/Kamele/n", "chameau/chameaux/m", "animal"),
    _noun("elephant", "Elefant/Elefanten/m", "éléphant/éléphants/m", "animal"),
]
THINGS = [
    _noun("ball", "Ball/Bälle/m", "ballon/ballons/m", "thing"),
    _noun("bag", "Tasche/Taschen/f", "sac/sacs/m", "thing", "Tüte/Tüten/f"),
    _noun("book", "Buch/Bücher/n", "livre/livres/m", "thing"),
    _noun("newspaper", "Zeitung/Zeitungen/f", "journal/journaux/m", "thing"),
    _noun("umbrella", "Regenschirm/Regenschirme/m", "parapluie/parapluies/m", "thing", "Schirm/Schirme/m"),
    _noun("cup", "Tasse/Tassen/f", "tasse/tasses/f", "thing", "Becher/Becher/m"),
    _noun("guitar", "Gitarre/Gitarren/f", "guitare/guitares/f", "thing"),
    _noun("flag", "Fahne/Fahnen/f", "drapeau/drapeaux/m", "thing", "Flagge/Flaggen/f"),
    _noun("box", "Kiste/Kisten/f", "boîte/boîtes/f", "thing", "Karton/Kartons/m"),
    _noun("stick", "Stock/Stöcke/m", "bâton/bâtons/m", "thing"),
    _noun("apple", "Apfel/Äpfel/m", "pomme/pommes/f", "thing"),
    _noun("sandwich/sandwiches", "Sandwich/Sandwiches/n", "sandwich/sandwichs/m", "thing", "Brot/Brote/n"),
    _noun("kite", "Drachen/Drachen/m", "cerf-volant/cerfs-volants/m", "thing"),
    _noun("bottle", "Flasche/Flaschen/f", "bouteille/bouteilles/f", "thing"),
    _noun("basket", "Korb/Körbe/m", "panier/paniers/m", "thing"),
    _noun("camera", "Kamera/Kameras/f", "caméra/caméras/f", "thing", "Fotoapparat/Fotoapparate/m"),
    _noun("map", "Karte/Karten/f", "carte/cartes/f", "thing", "Landkarte/Landkarten/f"),
    _noun("phone", "Telefon/Telefone/n", "téléphone/téléphones/m", "thing", "Handy/Handys/n"),
    _noun("backpack", "Rucksack/Rucksäcke/m", "sac à dos/sacs à dos/m", "thing"),
    _noun("ice cream/ice creams", "Eis/Eis/n", "glace/glaces/f", "thing"),
    _noun("bucket", "Eimer/Eimer/m", "seau/seaux/m", "thing"),
    _noun("rope", "Seil/Seile/n", "corde/cordes/f", "thing"),
    _noun("sign", "Schild/Schilder/n", "pancarte/pancartes/f", "thing"),
    _noun("banana", "Banane/Bananen/f", "banane/bananes/f", "thing"),
    _noun("pizza", "Pizza/Pizzen/f", "pizza/pizzas/f", "thing"),
    _noun("surfboard", "Surfbrett/Surfbretter/n", "planche de surf/planches de surf/f", "thing"),
    _noun("violin", "Geige/Geigen/f", "violon/violons/m", "thing"),
    _noun("drum", "Trommel/Trommeln/f", "tambour/tambours/m", "thing"),
    _noun("flower", "Blume/Blumen/f", "fleur/fleurs/f", "thing"),
    _noun("letter", "Brief/Briefe/m", "lettre/lettres/f", "thing"),
    _noun("shovel", "Schaufel/Schaufeln/f", "pelle/pelles/f", "thing"),
    _noun("hammer", "Hammer/Hämmer/m", "marteau/marteaux/m", "thing"),
]
CLOTHES = [
    _noun("shirt", "Hemd/Hemden/n", "chemise/chemises/f", "clothing"),
    _noun("jacket", "Jacke/Jacken/f", "veste/vestes/f", "clothing"),
    _noun("coat", "Mantel/Mäntel/m", "manteau/manteaux/m", "clothing"),
    _noun("dress/dresses", "Kleid/Kleider/n", "robe/robes/f", "clothing"),
    _noun("hat", "Hut/Hüte/m", "chapeau/chapeaux/m", "clothing"),
    _noun("sweater", "Pullover/Pullover/m", "pull/pulls/m", "clothing", "Pulli/Pullis/m"),
    _noun("skirt", "Rock/Röcke/m", "jupe/jupes/f", "clothing"),
    _noun("scarf/scarves", "Schal/Schals/m", "écharpe/écharpes/f", "clothing"),
    _noun("cap", "Mütze/Mützen/f", "casquette/casquettes/f", "clothing", "Kappe/Kappen/f"),
    _noun("uniform", "Uniform/Uniformen/f", "uniforme/uniformes/m", "clothing"),
    _noun("T-shirt", "T-Shirt/T-Shirts/n", "t-shirt/t-shirts/m", "clothing"),
    _noun("apron", "Schürze/Schürzen/f", "tablier/tabliers/m", "clothing"),
    _noun("helmet", "Helm/Helme/m", "casque/casques/m", "clothing"),
]


@dataclass(frozen=True)
class Adjective:
    en: str
    de: str  # the stem, which takes the endings
    fr: tuple[str, str, str, str]  # masculine, feminine, masculine plural, feminine plural


# Adjectives of age and size come before the noun in French too; colours come after it.
SIZES = [
    Adjective("young", "jung", ("jeune", "jeune", "jeunes", "jeunes")),
    Adjective("little", "klein", ("petit", "petite", "petits", "petites")),
    Adjective("old", "alt", ("vieux", "vieille", "vieux", "vieilles")),
    Adjective("tall", "groß", ("grand", "grande", "grands", "grandes")),
]
COLOURS = [
    Adjective("red", "rot", ("rouge", "rouge", "rouges", "rouges")),
    Adjective("blue", "blau", ("bleu", "bleue", "bleus", "bleues")),
    Adjective("black", "schwarz", ("noir", "noire", "noirs", "noires")),
    Adjective("white", "weiß", ("blanc", "blanche", "blancs", "blanches")),
    Adjective("green", "grün", ("vert", "verte", "verts", "vertes")),
    Adjective("yellow", "gelb", ("jaune", "jaune", "jaunes", "jaunes")),
    Adjective("brown", "braun", ("marron", "marron", "marron", "marron")),
    Adjective("grey", "grau", ("gris", "grise", "gris", "grises")),
]


@dataclass(frozen=True)
class Verb:
    en: str  # the -ing form
    de: tuple[tuple[str, str], ...]  # (singular, plural) present tense, synonyms
    fr: tuple[str, str]  # singular, plural present tense
    subjects: tuple[str, ...]  # the kinds that do it
    objects: tuple[str, ...] = ()  # a transitive verb's objects (English singular nouns)


def _verb(en: str, de: str, fr: str, subjects: str, objects: str = "", *synonyms: str) -> Verb:
    german = tuple(tuple(word.split("/")) for word in (de, *synonyms))
    return Verb(en, german, tuple(fr.split("/")), tuple(subjects.split()), tuple(objects.split(",")) if objects else ())


ALL, PERSON = "person animal", "person"
VERBS = [
    _verb("walking", "geht/gehen", "marche/marchent", ALL, "", "spaziert/spazieren"),
    _verb("running", "läuft/laufen", "court/courent", ALL, "", "rennt/rennen"),
    _verb("playing", "spielt/spielen", "joue/jouent", ALL),
    _verb("dancing", "tanzt/tanzen", "danse/dansent", PERSON),
    _verb("waiting", "wartet/warten", "attend/attendent", ALL),
    _verb("sleeping", "schläft/schlafen", "dort/dorment", ALL),
    _verb("jumping", "springt/springen", "saute/sautent", ALL, "", "hüpft/hüpfen"),
    _verb("singing", "singt/singen", "chante/chantent", PERSON),
    _verb("working", "arbeitet/arbeiten", "travaille/travaillent", PERSON),
    _verb("laughing", "lacht/lachen", "rit/rient", PERSON),
    _verb("swimming", "schwimmt/schwimmen", "nage/nagent", ALL),
    _verb("climbing", "klettert/klettern", "grimpe/grimpent", ALL),
    _verb("cooking", "kocht/kochen", "cuisine/cuisinent", PERSON),
    _verb("talking", "spricht/sprechen", "parle/parlent", PERSON, "", "redet/reden"),
    _verb("smiling", "lächelt/lächeln", "sourit/sourient", PERSON),
    _verb("shouting", "ruft/rufen", "crie/crient", PERSON, "", "schreit/schreien"),
    _verb("standing", "steht/stehen", "est debout/sont debout", ALL),
    _verb("waving", "winkt/winken", "fait signe/font signe", PERSON),
    _verb(
        "holding",
        "hält/halten",
        "tient/tiennent",
        PERSON,
        "ball,bag,book,umbrella,cup,guitar,flag,box,kite,bottle,basket,camera,map,phone,sign,flower,rope,shovel,hammer",
    ),  # fmt: skip
    _verb(
        "carrying",
        "trägt/tragen",
        "porte/portent",
        PERSON,
        "bag,box,guitar,flag,umbrella,stick,basket,backpack,bucket,surfboard,rope,sign,shovel,drum,violin",
    ),  # fmt: skip
    _verb("reading", "liest/lesen", "lit/lisent", PERSON, "book,newspaper,map,letter,sign"),
    _verb("throwing", "wirft/werfen", "lance/lancent", PERSON, "ball,stick,apple,banana"),
    _verb("eating", "isst/essen", "mange/mangent", PERSON, "apple,sandwich,banana,pizza,ice cream"),
    _verb(
        "buying",
        "kauft/kaufen",
        "achète/achètent",
        PERSON,
        "bag,book,newspaper,umbrella,cup,kite,apple,flower,bottle,map,ice cream,banana,camera,backpack",
    ),  # fmt: skip
    _verb("catching", "fängt/fangen", "attrape/attrapent", ALL, "ball,stick"),
    _verb("looking at", "betrachtet/betrachten", "regarde/regardent", ALL, ",".join(n.en[0] for n in THINGS)),
    _verb("opening", "öffnet/öffnen", "ouvre/ouvrent", PERSON, "box,bottle,letter,bag,backpack,umbrella"),
    _verb("repairing", "repariert/reparieren", "répare/réparent", PERSON, "phone,umbrella,camera,drum,kite"),
    _verb("pulling", "zieht/ziehen", "tire/tirent", ALL, "rope,box,basket,bucket"),
    _verb("painting", "malt/malen", "peint/peignent", PERSON, "sign,box,flower", "bemalt/bemalen"),
]
THINGS_BY_NAME = {noun.en[0]: noun for noun in THINGS}
COLOURED = {"ball", "bag", "umbrella", "cup", "flag", "box", "kite", "book", "apple", "bottle", "basket", "phone"}
COLOURED |= {"backpack", "bucket", "rope", "sign", "surfboard", "drum", "flower", "letter", "shovel"}

# (English, German synonyms, French): where it happens.
PLACES = [
    ("on the beach", ("am Strand", "an einem Strand"), "sur la plage"),
    ("in the park", ("im Park", "in einem Park"), "dans le parc"),
    ("on the street", ("auf der Straße", "auf der Fahrbahn"), "dans la rue"),
    ("in the snow", ("im Schnee",), "dans la neige"),
    ("in front of a building", ("vor einem Gebäude", "vor einem Haus"), "devant un bâtiment"),
    ("on a bench", ("auf einer Bank",), "sur un banc"),
    ("on the grass", ("auf dem Rasen", "auf der Wiese"), "sur l'herbe"),
    ("at the market", ("auf dem Markt", "auf einem Markt"), "au marché"),
    ("in a kitchen", ("in einer Küche",), "dans une cuisine"),
    ("on a stage", ("auf einer Bühne", "auf der Bühne"), "sur une scène"),
    ("by the river", ("am Fluss", "am Ufer des Flusses"), "au bord de la rivière"),
    ("in the garden", ("im Garten",), "dans le jardin"),
    ("at the station", ("am Bahnhof", "vor dem Bahnhof"), "à la gare"),
    ("in the city", ("in der Stadt", "in der Innenstadt"), "en ville"),
    ("near a fountain", ("in der Nähe eines Brunnens", "neben einem Brunnen"), "près d'une fontaine"),
    ("under a tree", ("unter einem Baum",), "sous un arbre"),
    ("in the rain", ("im Regen",), "sous la pluie"),
    ("on a boat", ("auf einem Boot",), "sur un bateau"),
    ("in a classroom", ("in einem Klassenzimmer",), "dans une salle de classe"),
    ("on a mountain", ("auf einem Berg",), "sur une montagne"),
    ("in the forest", ("im Wald",), "dans la forêt"),
    ("on a bridge", ("auf einer Brücke",), "sur un pont"),
    ("at the zoo", ("im Zoo",), "au zoo"),
    ("in a restaurant", ("in einem Restaurant", "in einem Lokal"), "dans un restaurant"),
    ("on the sidewalk", ("auf dem Bürgersteig", "auf dem Gehweg"), "sur le trottoir"),
    ("in a field", ("auf einem Feld",), "dans un champ"),
    ("next to a car", ("neben einem Auto", "neben einem Wagen"), "à côté d'une voiture"),
    ("at the playground", ("auf dem Spielplatz",), "sur l'aire de jeux"),
    ("in the desert", ("in der Wüste",), "dans le désert"),
    ("on a roof", ("auf einem Dach",), "sur un toit"),
    ("in a shop", ("in einem Geschäft", "in einem Laden"), "dans un magasin"),
    ("at the airport", ("am Flughafen",), "à l'aéroport"),
    ("at the lake", ("am See",), "au bord du lac"),
    ("in a hospital", ("in einem Krankenhaus",), "dans un hôpital"),
    ("in the library", ("in der Bibliothek",), "à la bibliothèque"),
]
# When: English and French say it last, German before the object and the place.
TIMES = [
    ("in the morning", ("am Morgen", "morgens"), "le matin"),
    ("at night", ("in der Nacht", "nachts"), "la nuit"),
    ("in the evening", ("am Abend", "abends"), "le soir"),
    ("on a sunny day", ("an einem sonnigen Tag",), "par une journée ensoleillée"),
    ("in winter", ("im Winter",), "en hiver"),
    ("in summer", ("im Sommer",), "en été"),
]
NUMBERS = [
    ("two", "zwei", "deux"),
    ("three", "drei", "trois"),
    ("four", "vier", "quatre"),
    ("five", "fünf", "cinq"),
    ("several", "mehrere", "plusieurs"),
]


@dataclass(frozen=True)
class Clause:
    """Who (``number`` of ``subject``, 0 for one with an article), what, and where."""

    subject: Noun
    number: int  # index into NUMBERS + 1; 0 is one
    size: Adjective | None
    clothing: tuple[Adjective, Noun] | None
    verb: Verb
    thing: tuple[Adjective | None, Noun] | None
    place: int
    time: int | None = None


def _clause(rng: random.Random) -> Clause:
    verb = rng.choice(VERBS)
    subject = rng.choice([n for n in PEOPLE + ANIMALS if n.kind in verb.subjects])
    number = rng.choice([0, 0, 0, 0, 1, 2, 3, 4, 5])
    size = rng.choice(SIZES) if rng.random() < 0.35 else None
    clothing = None
    if subject.kind == "person" and not number and rng.random() < 0.4:
        clothing = (rng.choice(COLOURS), rng.choice(CLOTHES))
    thing = None
    if verb.objects:
        noun = THINGS_BY_NAME[rng.choice(verb.objects)]
        thing = (rng.choice(COLOURS) if noun.en[0] in COLOURED and rng.random() < 0.5 else None, noun)
    time = rng.randrange(len(TIMES)) if rng.random() < 0.15 else None
    return Clause(subject, number, size, clothing, verb, thing, rng.randrange(len(PLACES)), time)


def _en_article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _en(c: Clause) -> str:
    noun = c.subject.en[1 if c.number else 0]
    first = c.size.en if c.size else noun
    words = [NUMBERS[c.number - 1][0] if c.number else _en_article(first), c.size.en if c.size else "", noun]
    if c.clothing:
        colour, item = c.clothing
        words += ["in", _en_article(colour.en), colour.en, item.en[0]]
    words += ["are" if c.number else "is", c.verb.en]
    if c.thing:
        colour, item = c.thing
        words += [_en_article(colour.en if colour else item.en[0]), colour.en if colour else "", item.en[0]]
    words.append(PLACES[c.place][0])
    words.append(TIMES[c.time][0] if c.time is not None else "")
    return " ".join(w for w in words if w)


# German adjective endings after "ein" (nominative, accusative, dative) and with no article in the plural.
_DE_ENDINGS = {
    "nom": {MASC: "er", FEM: "e", NEUT: "es"},
    "acc": {MASC: "en", FEM: "e", NEUT: "es"},
    "dat": {MASC: "en", FEM: "en", NEUT: "en"},
}
_DE_ARTICLES = {
    "nom": {MASC: "ein", FEM: "eine", NEUT: "ein"},
    "acc": {MASC: "einen", FEM: "eine", NEUT: "ein"},
    "dat": {MASC: "einem", FEM: "einer", NEUT: "einem"},
}


def _de_phrase(case: str, adjective: Adjective | None, word: German) -> list[str]:
    ending = _DE_ENDINGS[case][word.gender]
    return [_DE_ARTICLES[case][word.gender], adjective.de + ending if adjective else "", word.singular]


def _de(c: Clause, pick) -> str:
    subject = pick(c.subject.de)
    if c.number:
        words = [NUMBERS[c.number - 1][1], c.size.de + "e" if c.size else "", subject.plural]
    else:
        words = _de_phrase("nom", c.size, subject)
    if c.clothing:
        colour, item = c.clothing
        words += ["in", *_de_phrase("dat", colour, pick(item.de))]
    singular, plural = pick(c.verb.de)
    words.append(plural if c.number else singular)
    words.append(pick(TIMES[c.time][1]) if c.time is not None else "")
    if c.thing:
        colour, item = c.thing
        words += _de_phrase("acc", colour, pick(item.de))
    words.append(pick(PLACES[c.place][1]))
    return " ".join(w for w in words if w)


def _fr_adjective(adjective: Adjective, gender: str, plural: bool, before_vowel: bool = False) -> str:
    if adjective.en == "old" and gender == MASC and before_vowel and not plural:
        return "vieil"
    return adjective.fr[(2 if plural else 0) + (gender == FEM)]


def _fr(c: Clause) -> str:
    sg, pl, gender = c.subject.fr
    if c.number:
        words = [NUMBERS[c.number - 1][2]]
        words += [_fr_adjective(c.size, gender, True) if c.size else "", pl]
    else:
        words = ["une" if gender == FEM else "un"]
        words += [_fr_adjective(c.size, gender, False, c.subject.fr_vowel) if c.size else "", sg]
    if c.clothing:
        colour, item = c.clothing
        words += ["en", item.fr[0], _fr_adjective(colour, item.fr[2], False)]
    words.append(c.verb.fr[1 if c.number else 0])
    if c.thing:
        colour, item = c.thing
        words += ["une" if item.fr[2] == FEM else "un", item.fr[0]]
        words.append(_fr_adjective(colour, item.fr[2], False) if colour else "")
    words.append(PLACES[c.place][2])
    words.append(TIMES[c.time][2] if c.time is not None else "")
    return " ".join(w for w in words if w)


@dataclass(frozen=True)
class Caption:
    clauses: tuple[Clause, ...]  # one, or two joined by "and"

    def render(self, lang: str, synonyms: random.Random | None = None) -> str:
        """The caption in ``lang``; with ``synonyms``, German words are drawn from their synonyms by it."""

        def pick(options):
            return synonyms.choice(options) if synonyms else options[0]

        render = {"en": _en, "de": lambda c: _de(c, pick), "fr": _fr}[lang]
        joined = {"en": " and ", "de": " und ", "fr": " et "}[lang].join(map(render, self.clauses))
        return joined[0].upper() + joined[1:] + "."


def captions(n: int, seed: int = 0) -> list[Caption]:
    """``n`` distinct captions, the same for the same seed; about one in five has two clauses."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        caption = Caption(tuple(_clause(rng) for _ in range(2 if rng.random() < 0.2 else 1)))
        english = caption.render("en")
        if english not in seen:
            seen.add(english)
            out.append(caption)
    return out


def parallel(n: int, seed: int = 0, langs: tuple[str, ...] = ("en", "de")) -> dict[str, list[str]]:
    """``n`` line-aligned captions in each of ``langs``."""
    corpus = captions(n, seed)
    return {lang: [c.render(lang) for c in corpus] for lang in langs}


# Split sizes of the stand-in for Multi30k: the files `mtkit prepare multi30k_*` reads, under their names.
MIRROR_SPLITS = {"train": 2_000, "val": 100, "test_2016_flickr": 100}


def write_mirror(folder: Path) -> dict[str, str]:
    """Multi30k's file layout (SPLIT.LANG.gz for en, de and fr) filled with captions; returns each file's SHA-256,
    for the tests to put in the corpus catalogue in place of the published files' digests."""
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(MIRROR_SPLITS.values())
    corpus, start = parallel(total, seed=30, langs=LANGS), 0
    digests = {}
    for split, size in MIRROR_SPLITS.items():
        lines = {lang: corpus[lang][start : start + size] for lang in LANGS}
        start += size
        if split == "train":  # for cleaning: a line to normalise; an empty, a repeated and an "@@" (ratio) pair
            lines["en"][0] = lines["en"][0].replace(" ", "\u00a0 ", 1) + " "
            for lang in LANGS:
                lines[lang] += ["", lines[lang][1], lines[lang][2] if lang == "en" else "@@"]
        for lang in LANGS:
            path = folder / f"{split}.{lang}.gz"
            # mtime=0: the same bytes, and so the same digest, every time
            path.write_bytes(gzip.compress(("\n".join(lines[lang]) + "\n").encode(), mtime=0))
            digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests
