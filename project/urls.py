from django.contrib import admin
from django.urls import path

from project.shop import views

urlpatterns = [
    path("", views.orders, name="orders"),
    path("admin/", admin.site.urls),
]
